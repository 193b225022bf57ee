"""Shared by the alert tests: a real HTTP webhook receiver on 127.0.0.1 that records posts.

Not a mock: a ``ThreadingHTTPServer`` on a free loopback port. Each test scripts its
answers (status, headers, body, delay) and reads back exactly what arrived.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest


@dataclass
class Reply:
    status: int = 200
    body: bytes = b"ok"
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass
class Received:
    path: str
    raw_query: str
    headers: dict[str, str]
    body: bytes
    at: float

    @property
    def query(self) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(self.raw_query).items()}

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class WebhookServer:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.replies: dict[str, deque[Reply]] = {}
        self.down_until = 0.0
        """Monotonic time until which every post is answered 503 (an outage)."""
        self.refused = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                if len(body) < length:  # the client died mid-request: a server drops it
                    return
                parts = urlsplit(self.path)
                with server._lock:
                    if time.monotonic() < server.down_until:
                        server.refused += 1
                        down = True
                    else:
                        down = False
                if down:
                    try:
                        self.send_response(503)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                    except OSError:
                        pass
                    return
                with server._lock:
                    server.received.append(
                        Received(
                            parts.path, parts.query, dict(self.headers), body, time.monotonic()
                        )
                    )
                    queue = server.replies.get(parts.path)
                    reply = queue.popleft() if queue else Reply()
                if reply.delay_s:
                    time.sleep(reply.delay_s)
                try:
                    self.send_response(reply.status)
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:
                    pass  # the client gave up (test over)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def base(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def url(self, path: str) -> str:
        return self.base + path

    def script(self, path: str, *replies: Reply) -> None:
        """Answer the next posts to ``path`` with ``replies``, then 200 ``ok``."""
        with self._lock:
            self.replies.setdefault(path, deque()).extend(replies)

    def outage(self, seconds: float) -> None:
        """Answer every post with 503 for the next ``seconds`` (nothing is recorded)."""
        with self._lock:
            self.down_until = time.monotonic() + seconds

    def at(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == path]

    def wait_for(
        self, count: int, timeout_s: float = 10.0, path: str | None = None
    ) -> list[Received]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.at(path) if path else list(self.received)
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture(name="webhook_server")
def webhook_server_fixture() -> Iterator[WebhookServer]:
    """Import this into a test module to use the ``webhook_server`` fixture there."""
    server = WebhookServer()
    try:
        yield server
    finally:
        server.close()
