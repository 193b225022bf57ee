"""A local webhook receiver for the demo: it stands in for the ops chat.

It accepts JSON POSTs on 127.0.0.1 and keeps them, so the demo can show that the
alerter really posted, and what.

>>> import httpx
>>> with WebhookReceiver() as rx:
...     _ = httpx.post(rx.url + "/hook", json={"status": "firing"})
...     rx.received[0]["path"], rx.received[0]["body"]["status"]
('/hook', 'firing')
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["WebhookReceiver"]


class WebhookReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.received: list[dict[str, Any]] = []
        lock = threading.Lock()
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length", 0))
                raw = self.rfile.read(length)
                try:
                    body: Any = json.loads(raw)
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                with lock:
                    received.append({"path": self.path, "body": body})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"ok":true}')

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # quiet: the demo prints what matters

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
