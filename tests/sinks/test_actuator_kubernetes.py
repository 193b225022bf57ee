"""The Kubernetes backend through the real ``kubernetes`` client, against a loopback API.

:class:`FakeKubeAPI` is a small HTTP server on 127.0.0.1 that serves the endpoints the
backend calls, with the API server's semantics that matter here: every write bumps
``metadata.resourceVersion``; a write that carries a stale one gets 409 Conflict; JSON
merge patches replace lists; strategic-merge patches of ``status.conditions`` merge by
``type``; an Event name that exists gets 409; an Event whose ``involvedObject.namespace``
does not fit its namespace gets 422 (the API server's ``ValidateEvent`` rule, see
:func:`event_namespace_error`). Other content types get 415, so a client that sends a
strategic-merge patch of the taints fails here. SelfSubjectAccessReviews answer from
:attr:`FakeKubeAPI.denied`.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiClient, Configuration

from sinks.actuator.backends import (
    ActuatorConfigError,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.config import ActuatorConfig, KubernetesSettings
from sinks.actuator.consumer import Actuator
from sinks.actuator.kubernetes_backend import KubernetesBackend, event_name, load_api_client
from sinks.actuator.ledger import Ledger
from streams.commands import IsolationCommand

pytestmark = pytest.mark.timeout(30)

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
                invalid = event_namespace_error(m.group(1), body)
                if invalid:
                    return status(422, "Invalid", invalid)
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


def event_namespace_error(namespace: str, event: dict[str, Any]) -> str | None:
    """The API server's check of a core/v1 Event's namespaces, or None when it passes.

    As in Kubernetes' ``pkg/apis/core/validation/events.go`` (``legacyValidateEvent``):
    without ``eventTime``, an involvedObject with no namespace (a Node) is allowed only
    in namespace "" or "default", and one with a namespace must match the Event's;
    with ``eventTime``, no namespace is allowed in "default" and "kube-system".
    """
    inv_ns = event.get("involvedObject", {}).get("namespace") or ""
    name = event["metadata"]["name"]
    msg = (
        f'Event "{name}" is invalid: involvedObject.namespace: Invalid value: "{inv_ns}": '
        "does not match event.namespace"
    )
    if not event.get("eventTime"):
        if not inv_ns:
            return None if namespace in ("", "default") else msg
        return None if inv_ns == namespace else msg
    if not inv_ns and namespace not in ("default", "kube-system"):
        return msg
    return None


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


@pytest.fixture
def api() -> Iterator[tuple[FakeKubeAPI, str]]:
    """A running :class:`FakeKubeAPI` and its base URL."""
    fake = FakeKubeAPI()
    with serve(fake) as url:
        yield fake, url


def backend_for(url: str, **settings: Any) -> KubernetesBackend:
    conf = Configuration(host=url)
    return KubernetesBackend(KubernetesSettings(**settings), ApiClient(conf))


def command(**kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id="c4-7",
        ts_us=1,
        job="llm-70b",
        host="gpu-node-3",
        gpu=2,
        fault="straggler",
        action="cordon",
        confidence=0.93,
        reason="gpu-node-3 GPU 2 arrived last in 40 of 40 all-reduces (median +18 ms).",
        evidence={"comms": ["0xa"]},
        dry_run=False,  # absent means dry run
    )
    base.update(kw)
    return IsolationCommand(**base)


def test_cordon_keeps_other_taints_sets_condition_and_posts_event(
    api: tuple[FakeKubeAPI, str],
) -> None:
    fake, url = api
    fake.add_node("gpu-node-3", taints=[GPU_TAINT])
    out = backend_for(url).apply(command())
    node = fake.nodes["gpu-node-3"]
    assert out.changed
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"] == [
        GPU_TAINT,
        {"key": KEY, "value": "straggler", "effect": "NoSchedule"},
    ]
    assert node["futureField"] == {"keep": True}  # merge patch, not a model round trip
    spec_write = fake.writes("/nodes/gpu-node-3")[0]
    assert spec_write["ctype"] == "application/merge-patch+json"
    assert spec_write["body"]["metadata"]["resourceVersion"] == "1001"
    conds = {c["type"]: c for c in node["status"]["conditions"]}
    assert conds["Ready"] == READY  # the kubelet's condition stays
    assert conds["C4streamFaulty"]["status"] == "True"
    assert conds["C4streamFaulty"]["reason"] == "Straggler"
    assert conds["C4streamFaulty"]["message"] == command().reason
    [(ns, _), *more] = fake.events
    ev = fake.events[(ns, _)]
    assert not more and ns == "default"
    assert ev["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Node",
        "name": "gpu-node-3",
        "uid": "uid-gpu-node-3",
    }
    assert ev["type"] == "Warning" and ev["reason"] == "Straggler"
    assert command().reason in ev["message"] and "gpu 2" in ev["message"]


def test_a_taint_added_between_read_and_write_survives_the_retry(
    api: tuple[FakeKubeAPI, str],
) -> None:
    fake, url = api
    fake.add_node("gpu-node-3", taints=[GPU_TAINT])

    def race_once(f: FakeKubeAPI, name: str) -> None:
        f.before_spec_write = None
        f.add_taint_concurrently(name, OTHER_TAINT)

    fake.before_spec_write = race_once
    backend_for(url).apply(command())
    node = fake.nodes["gpu-node-3"]
    assert fake.conflicts == 1
    assert node["spec"]["taints"] == [
        GPU_TAINT,
        OTHER_TAINT,
        {"key": KEY, "value": "straggler", "effect": "NoSchedule"},
    ]
    assert node["spec"]["unschedulable"] is True
    gets = [r for r in fake.requests if r["method"] == "GET"]
    assert len(gets) == 2  # read, conflict, read again, write


def test_endless_conflicts_give_up_after_the_bound(api: tuple[FakeKubeAPI, str]) -> None:
    fake, url = api
    fake.add_node("gpu-node-3")
    n = [0]

    def always_race(f: FakeKubeAPI, name: str) -> None:
        n[0] += 1
        f.add_taint_concurrently(name, {"key": f"other/{n[0]}", "effect": "NoSchedule"})

    fake.before_spec_write = always_race
    with pytest.raises(TransientActionError, match="3 writes lost"):
        backend_for(url, conflict_retries=3).apply(command())
    assert fake.conflicts == 3
    assert "unschedulable" not in fake.nodes["gpu-node-3"]["spec"]
    assert not fake.events  # no Event for an action that did not happen


def test_repeat_is_a_no_op_and_a_new_fault_updates_our_taint_only(
    api: tuple[FakeKubeAPI, str],
) -> None:
    fake, url = api
    fake.add_node("gpu-node-3", taints=[GPU_TAINT])
    be = backend_for(url)
    assert be.apply(command()).changed
    writes = len(fake.writes())
    again = be.apply(command())
    assert not again.changed and "nothing changed" in again.detail
    # Only the Event POST was tried again (and answered 409 AlreadyExists).
    assert [r["method"] for r in fake.writes()[writes:]] == ["POST"]
    be.apply(command(id="c4-8", fault="slow_nic", action="cordon_and_taint", nic="mlx5_1"))
    taints = fake.nodes["gpu-node-3"]["spec"]["taints"]
    assert taints == [
        GPU_TAINT,
        {"key": KEY, "value": "slow_nic", "effect": "NoSchedule"},
        {"key": KEY, "value": "slow_nic", "effect": "NoExecute"},
    ]
    cond = next(
        c for c in fake.nodes["gpu-node-3"]["status"]["conditions"] if c["type"] == "C4streamFaulty"
    )
    assert cond["reason"] == "SlowNic"
    assert len(fake.events) == 2


def test_restart_job_marks_the_node_without_cordoning(api: tuple[FakeKubeAPI, str]) -> None:
    fake, url = api
    fake.add_node("gpu-node-3", taints=[GPU_TAINT])
    backend_for(url).apply(command(action="restart_job", fault="comm_hang"))
    node = fake.nodes["gpu-node-3"]
    assert node["spec"] == {"taints": [GPU_TAINT]}
    assert not fake.writes("/nodes/gpu-node-3")
    assert any(c["type"] == "C4streamFaulty" for c in node["status"]["conditions"])
    assert len(fake.events) == 1


def test_error_policy(api: tuple[FakeKubeAPI, str]) -> None:
    fake, url = api
    with pytest.raises(PermanentActionError, match="No such node"):
        backend_for(url).apply(command(host="ghost"))
    fake.add_node("gpu-node-3")
    fake.forbidden = True
    with pytest.raises(ActuatorConfigError, match="rbac-actuator.yaml"):
        backend_for(url).apply(command())
    closed = "http://127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(TransientActionError):
        backend_for(closed, request_timeout_s=2.0).apply(command())


def test_dry_run_and_deny_never_reach_the_api(api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    fake, url = api
    fake.add_node("gpu-node-3")
    be = backend_for(url)
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        dry = Actuator(ActuatorConfig(), be, led).handle(command())
        denied = Actuator(ActuatorConfig(execute=True, deny=("gpu-node-*",)), be, led).handle(
            command(id="c4-9")
        )
        own_dry = Actuator(ActuatorConfig(execute=True), be, led).handle(
            command(id="c4-10", dry_run=True)
        )
        alert = Actuator(ActuatorConfig(execute=True), be, led).handle(
            command(id="c4-11", action="alert_only")
        )
    assert (dry.decision, denied.decision, own_dry.decision, alert.decision) == (
        "dry_run",
        "denied",
        "dry_run",
        "alert_only",
    )
    assert "set spec.unschedulable=true" in dry.detail
    assert f"taint {KEY}=straggler:NoSchedule" in dry.detail
    assert fake.requests == []


def test_kubeconfig_file_is_honoured(api: tuple[FakeKubeAPI, str], tmp_path: Path) -> None:
    fake, url = api
    fake.add_node("gpu-node-3")
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(  # JSON is YAML
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": url}}],
                "users": [{"name": "u", "user": {"token": "s3cret-token"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    settings = KubernetesSettings(kubeconfig=str(kubeconfig))
    t0 = time.monotonic()
    KubernetesBackend(settings, load_api_client(settings)).apply(command())
    assert time.monotonic() - t0 < 5
    assert fake.nodes["gpu-node-3"]["spec"]["unschedulable"] is True
    assert {r["auth"] for r in fake.requests} == {"Bearer s3cret-token"}
    with pytest.raises(ActuatorConfigError, match="cannot load kubeconfig"):
        load_api_client(KubernetesSettings(kubeconfig=str(tmp_path / "missing")))


def test_rbac_manifest_grants_exactly_what_the_backend_calls(
    api: tuple[FakeKubeAPI, str],
) -> None:
    import yaml

    fake, url = api
    fake.add_node("gpu-node-3")
    be = backend_for(url)
    be.apply(command())
    be.apply(command(id="c4-2", action="cordon_and_taint"))
    be.apply(command(id="c4-3", action="restart_job"))
    verbs = {"GET": "get", "PATCH": "patch", "PUT": "update", "POST": "create"}
    used: set[tuple[str, str]] = set()
    for r in fake.requests:
        resource = "events" if r["path"].endswith("/events") else "nodes"
        if r["path"].endswith("/status"):
            resource = "nodes/status"
        used.add((resource, verbs[r["method"]]))
    manifest = Path(__file__).parents[2] / "compose" / "k8s" / "rbac-actuator.yaml"
    granted: set[tuple[str, str]] = set()
    for doc in yaml.safe_load_all(manifest.read_text()):
        for rule in doc.get("rules", []):
            assert rule["apiGroups"] == [""]
            granted |= {(res, v) for res in rule["resources"] for v in rule["verbs"]}
    assert (
        used
        == granted
        == {
            ("nodes", "get"),
            ("nodes", "patch"),
            ("nodes/status", "patch"),
            ("events", "create"),
        }
    )


def test_events_in_another_namespace_pass_the_api_servers_rule(
    api: tuple[FakeKubeAPI, str],
) -> None:
    fake, url = api
    fake.add_node("gpu-node-3")
    out = backend_for(url, event_namespace="c4stream").apply(command())
    assert "Event not posted" not in out.detail
    [(ns, _)] = fake.events
    ev = fake.events[(ns, _)]
    assert ns == "c4stream" and ev["involvedObject"]["namespace"] == "c4stream"
    assert ev["involvedObject"]["kind"] == "Node" and ev["involvedObject"]["name"] == "gpu-node-3"
    # In "default" the Node's Event carries no namespace, so kubectl describe node shows it.
    backend_for(url).apply(command(id="c4-8"))
    assert (
        "namespace"
        not in fake.events[("default", event_name("gpu-node-3", "c4-8"))]["involvedObject"]
    )


def test_a_rejected_event_does_not_fail_an_action_that_happened(
    api: tuple[FakeKubeAPI, str],
) -> None:
    fake, url = api
    fake.add_node("gpu-node-3")
    real = fake.handle

    def reject_events(method: str, path: str, ctype: str, body: Any, auth: str | None):
        if path.endswith("/events"):
            return status(422, "Invalid", "metadata.name: too long")
        return real(method, path, ctype, body, auth)

    fake.handle = reject_events  # type: ignore[method-assign]
    out = backend_for(url).apply(command())
    assert fake.nodes["gpu-node-3"]["spec"]["unschedulable"] is True
    assert "Event not posted" in out.detail and "too long" in out.detail


def test_check_asks_the_api_server_for_each_permission(api: tuple[FakeKubeAPI, str]) -> None:
    fake, url = api
    lines = backend_for(url, event_namespace="c4stream").check()
    assert lines == [
        "kubernetes: get nodes: allowed",
        "kubernetes: patch nodes: allowed",
        "kubernetes: patch nodes/status: allowed",
        "kubernetes: create events in namespace c4stream: allowed",
    ]
    fake.denied = {("nodes/status", "patch")}
    with pytest.raises(ActuatorConfigError, match="not allowed to patch nodes/status"):
        backend_for(url).check()
