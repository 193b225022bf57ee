"""A loopback stand-in for the Kubernetes API, kept ONLY for failure injection.

The actuator's Kubernetes tests run against a real kube-apiserver (tests/k8s_fixture.py).
This small HTTP server on 127.0.0.1 stays for what a real server cannot be made to do on
demand: answer 5xx, reject an Event the real server would accept, or a 409 at a chosen
moment. It serves the endpoints the backend calls with the semantics that matter:
every write bumps ``metadata.resourceVersion``; a write with a stale one gets 409; JSON
merge patches replace lists; strategic-merge patches of ``status.conditions`` merge by
``type``; an existing Event name gets 409. Other content types get 415.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kubernetes.client import ApiClient, Configuration

from sinks.actuator.config import KubernetesSettings
from sinks.actuator.kubernetes_backend import KubernetesBackend

KEY = "c4stream.io/fault"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OTHER_TAINT = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}
READY = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "ok"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeKubeAPI:
    """Node, node status and Event endpoints with resourceVersion checks (see module doc)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[dict[str, Any]] = []
        self.conflicts = 0
        self.forbidden = False
        self.fail_with = 0
        """An HTTP status every request gets (e.g. 503), 0: serve normally."""
        self.denied: set[tuple[str, str]] = set()
        """(resource[/subresource], verb) a SelfSubjectAccessReview answers not allowed."""
        self._rv = 1000
        # Called (under the lock) before a spec write is checked: simulates another
        # controller changing the node between our read and our write.
        self.before_spec_write: Callable[[FakeKubeAPI, str], None] | None = None

    def next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_node(self, name: str, taints: list[dict[str, Any]] | None = None) -> None:
        self.nodes[name] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": self.next_rv()},
            "spec": {"taints": list(taints or [])},
            "status": {"conditions": [dict(READY)]},
            # A field the client's models do not know: it must survive our writes.
            "futureField": {"keep": True},
        }

    def add_taint_concurrently(self, name: str, taint: dict[str, Any]) -> None:
        node = self.nodes[name]
        node["spec"].setdefault("taints", []).append(taint)
        node["metadata"]["resourceVersion"] = self.next_rv()

    def writes(self, path_suffix: str = "") -> list[dict[str, Any]]:
        return [
            r for r in self.requests if r["method"] != "GET" and r["path"].endswith(path_suffix)
        ]

    def handle(
        self, method: str, path: str, ctype: str, body: Any, auth: str | None
    ) -> tuple[int, dict[str, Any]]:
        with self.lock:
            self.requests.append(
                {"method": method, "path": path, "ctype": ctype, "body": body, "auth": auth}
            )
            if self.fail_with:
                return status(self.fail_with, "InternalError", "etcdserver: request timed out")
            if self.forbidden:
                return status(403, "Forbidden", "nodes is forbidden: User cannot patch")
            m = re.fullmatch(r"/api/v1/nodes/([^/]+)(/status)?", path)
            if m:
                return self._node(method, m.group(1), bool(m.group(2)), ctype, body)
            if path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews":
                attrs = body["spec"]["resourceAttributes"]
                res = attrs["resource"] + (
                    f"/{attrs['subresource']}" if attrs.get("subresource") else ""
                )
                allowed = (res, attrs["verb"]) not in self.denied
                return 201, {**body, "status": {"allowed": allowed}}
            m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path)
            if m and method == "POST":
                key = (m.group(1), body["metadata"]["name"])
                if key in self.events:
                    return status(409, "AlreadyExists", f"events {key[1]!r} already exists")
                self.events[key] = body
                return 201, body
            return status(404, "NotFound", f"no route {method} {path}")

    def _node(
        self, method: str, name: str, is_status: bool, ctype: str, body: Any
    ) -> tuple[int, dict[str, Any]]:
        node = self.nodes.get(name)
        if node is None:
            return status(404, "NotFound", f'nodes "{name}" not found')
        if method == "GET" and not is_status:
            return 200, node
        if method == "PATCH" and is_status:
            if ctype != "application/strategic-merge-patch+json":
                return status(415, "UnsupportedMediaType", f"status patch as {ctype}")
            conds = {c["type"]: c for c in node["status"]["conditions"]}
            for c in body.get("status", {}).get("conditions", []):
                conds[c["type"]] = merge_patch(conds.get(c["type"], {}), c)
            node["status"]["conditions"] = list(conds.values())
            node["metadata"]["resourceVersion"] = self.next_rv()
            return 200, node
        if method == "PATCH" and not is_status:
            if ctype != "application/merge-patch+json":
                # A strategic-merge patch would replace the taint list unguarded.
                return status(415, "UnsupportedMediaType", f"spec patch as {ctype}")
            if self.before_spec_write is not None:
                self.before_spec_write(self, name)
            sent_rv = (body.get("metadata") or {}).get("resourceVersion")
            if sent_rv is not None and sent_rv != node["metadata"]["resourceVersion"]:
                self.conflicts += 1
                return status(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                )
            new = merge_patch(node, body)
            pairs = [(t["key"], t["effect"]) for t in new["spec"].get("taints", [])]
            if len(pairs) != len(set(pairs)):
                return status(422, "Invalid", "spec.taints: Duplicate value")
            new["metadata"]["resourceVersion"] = self.next_rv()
            self.nodes[name] = new
            return 200, new
        return status(405, "MethodNotAllowed", f"{method} not served here")


def status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@contextlib.contextmanager
def serve(fake: FakeKubeAPI) -> Iterator[str]:
    """Serve ``fake`` on 127.0.0.1 (a free port) in a thread; yields the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            path = self.path.split("?", 1)[0]
            ctype = (self.headers.get("Content-Type") or "").split(";")[0]
            code, obj = fake.handle(
                self.command,
                path,
                ctype,
                json.loads(raw) if raw else None,
                self.headers.get("Authorization"),
            )
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_PUT = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def backend_for(url: str, **settings: Any) -> KubernetesBackend:
    conf = Configuration(host=url)
    return KubernetesBackend(KubernetesSettings(**settings), ApiClient(conf))
