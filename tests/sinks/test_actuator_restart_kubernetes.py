"""Restart after isolation on Kubernetes, through the real ``kubernetes`` client, against
the loopback API server of ``test_actuator_kubernetes.py`` extended with pods.

Pods are listed with label and field selectors as the API server does (equality terms),
and deleted with ``preconditions.uid`` checked (409 on a mismatch); a deleted pod keeps a
``deletionTimestamp`` (terminating), as it does while its containers stop. Every request
is recorded with its query, so the tests check the exact requests made.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from kubernetes.client import ApiClient, Configuration

from sinks.actuator.backends import ActuatorConfigError
from sinks.actuator.config import ActuatorConfig, KubernetesSettings, RestartSettings
from sinks.actuator.consumer import Actuator
from sinks.actuator.kubernetes_backend import KubernetesBackend
from sinks.actuator.ledger import Ledger
from sinks.actuator.restart import RestartHook, RestartLog
from sinks.actuator.restart_kubernetes import KubernetesRestarter
from streams.commands import IsolationCommand
from tests.sinks.test_actuator_kubernetes import FakeKubeAPI, status

pytestmark = pytest.mark.timeout(30)

NS = "default"
JOB = "llm-70b"


class FakeKubeWithPods(FakeKubeAPI):
    """:class:`FakeKubeAPI` plus the pod list and delete endpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.pod_requests: list[dict[str, Any]] = []
        self._uid = 0

    def add_pod(self, name: str, node: str, *, phase: str = "Running", job: str = JOB) -> None:
        self._uid += 1
        self.pods[(NS, name)] = {
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{self._uid}",
                         "labels": {"job-name": job}},
            "spec": {"nodeName": node},
            "status": {"phase": phase},
        }  # fmt: skip

    def handle_query(
        self, method: str, path: str, query: dict[str, str], ctype: str, body: Any, auth: Any
    ) -> tuple[int, dict[str, Any]]:
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?", path)
        if not m:
            return self.handle(method, path, ctype, body, auth)
        with self.lock:
            self.pod_requests.append({"method": method, "path": path, "query": query, "body": body})
            if self.forbidden:
                return status(403, "Forbidden", "pods is forbidden")
            ns, name = m.group(1), m.group(2)
            if method == "GET" and name is None:
                return 200, {"kind": "PodList", "items": self._select(ns, query)}
            if method == "DELETE" and name is not None:
                pod = self.pods.get((ns, name))
                if pod is None:
                    return status(404, "NotFound", f'pods "{name}" not found')
                want = ((body or {}).get("preconditions") or {}).get("uid")
                if want is not None and want != pod["metadata"]["uid"]:
                    return status(409, "Conflict", "Precondition failed: UID in precondition")
                pod["metadata"]["deletionTimestamp"] = "2026-12-01T09:00:00Z"
                return 200, pod
            return status(405, "MethodNotAllowed", f"{method} {path}")

    def _select(self, ns: str, query: dict[str, str]) -> list[dict[str, Any]]:
        labels = dict(t.split("=", 1) for t in query.get("labelSelector", "").split(",") if t)
        fields = dict(t.split("=", 1) for t in query.get("fieldSelector", "").split(",") if t)
        out = []
        for (pns, _), pod in sorted(self.pods.items()):
            have = pod["metadata"]["labels"]
            if pns != ns or any(have.get(k) != v for k, v in labels.items()):
                continue
            if "spec.nodeName" in fields and pod["spec"]["nodeName"] != fields["spec.nodeName"]:
                continue
            out.append(pod)
        return out


@contextlib.contextmanager
def serve(fake: FakeKubeWithPods) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            url = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            code, obj = fake.handle_query(
                self.command,
                url.path,
                query,
                (self.headers.get("Content-Type") or "").split(";")[0],
                json.loads(raw) if raw else None,
                self.headers.get("Authorization"),
            )
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_PATCH = do_PUT = do_POST = do_DELETE = _serve

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
def api() -> Iterator[tuple[FakeKubeWithPods, str]]:
    fake = FakeKubeWithPods()
    fake.add_node("gpu-node-3")
    fake.add_pod("llm-70b-worker-3", "gpu-node-3")
    fake.add_pod("llm-70b-worker-4", "gpu-node-4")
    fake.add_pod("other-job-0", "gpu-node-3", job="other-job")
    with serve(fake) as url:
        yield fake, url


def command(**kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id="c4-7",
        ts_us=1,
        job=JOB,
        host="gpu-node-3",
        gpu=2,
        fault="straggler",
        action="cordon",
        confidence=0.93,
        reason="gpu-node-3 GPU 2 arrived last in 40 of 40 all-reduces.",
        evidence={},
        dry_run=False,  # the worker decided to act (a command without it is a dry run)
    )
    base.update(kw)
    return IsolationCommand(**base)


def actuator(url: str | None, led: Ledger, rl: RestartLog, **restart: Any) -> Actuator:
    client = ApiClient(Configuration(host=url)) if url else None
    cfg = ActuatorConfig(execute=url is not None)
    rs = RestartSettings(**{"jobs": ("llm-*",), "execute": True, **restart})
    hook = RestartHook(rs, KubernetesRestarter(rs, KubernetesSettings(), client), rl)
    return Actuator(cfg, KubernetesBackend(KubernetesSettings(), client), led, restart=hook)


def test_cordon_then_the_jobs_pod_on_that_node_is_deleted_exactly(
    api: tuple[FakeKubeWithPods, str], tmp_path: Path
) -> None:
    fake, url = api
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        h = actuator(url, led, rl).handle(command())
        assert (h.decision, h.status) == ("act", "done")
        assert fake.nodes["gpu-node-3"]["spec"]["unschedulable"] is True
        worker3 = fake.pods[(NS, "llm-70b-worker-3")]
        assert fake.pod_requests == [
            {
                "method": "GET",
                "path": f"/api/v1/namespaces/{NS}/pods",
                "query": {
                    "labelSelector": "job-name=llm-70b",
                    "fieldSelector": "spec.nodeName=gpu-node-3",
                },
                "body": None,
            },
            {
                "method": "GET",
                "path": f"/api/v1/namespaces/{NS}/pods",
                "query": {"labelSelector": "job-name=llm-70b"},
                "body": None,
            },
            {
                "method": "DELETE",
                "path": f"/api/v1/namespaces/{NS}/pods/llm-70b-worker-3",
                "query": {},
                "body": {
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "preconditions": {"uid": worker3["metadata"]["uid"]},
                },
            },
        ]  # fmt: skip
        assert "deletionTimestamp" in worker3["metadata"]
        for other in ("llm-70b-worker-4", "other-job-0"):  # other nodes, other jobs: untouched
            assert "deletionTimestamp" not in fake.pods[(NS, other)]["metadata"]
        [row] = rl.entries()
        assert (row.status, row.target) == ("done", "llm-70b-worker-3")
        # redelivered: the ledger says done, no pod request at all
        n = len(fake.pod_requests)
        assert actuator(url, led, rl).handle(command()).decision == "duplicate"
        assert len(fake.pod_requests) == n


def test_pending_or_terminating_pods_mean_a_restart_is_under_way(
    api: tuple[FakeKubeWithPods, str], tmp_path: Path
) -> None:
    fake, url = api
    fake.add_pod("llm-70b-worker-9", "gpu-node-9", phase="Pending")
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        actuator(url, led, rl).handle(command())
        [row] = rl.entries()
    assert row.status == "skipped" and "llm-70b-worker-9 pending" in row.detail
    assert [r["method"] for r in fake.pod_requests] == ["GET", "GET"]  # no DELETE


def test_noexecute_eviction_already_restarting_is_not_deleted_again(
    api: tuple[FakeKubeWithPods, str], tmp_path: Path
) -> None:
    fake, url = api
    fake.pods[(NS, "llm-70b-worker-3")]["metadata"]["deletionTimestamp"] = "2026-12-01T09:00:00Z"
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        actuator(url, led, rl).handle(command(action="cordon_and_taint"))
        [row] = rl.entries()
    assert row.status == "skipped" and "worker-3 terminating" in row.detail
    assert "DELETE" not in [r["method"] for r in fake.pod_requests]


def test_a_replacement_pod_with_the_same_name_is_never_deleted(
    api: tuple[FakeKubeWithPods, str], tmp_path: Path
) -> None:
    fake, url = api
    rs = RestartSettings(jobs=("llm-*",), execute=True)
    restarter = KubernetesRestarter(rs, KubernetesSettings(), ApiClient(Configuration(host=url)))
    plan = restarter.plan(command(), live=True)
    # between plan and delete, the pod was replaced by one of the same name (new uid)
    del fake.pods[(NS, "llm-70b-worker-3")]
    fake.add_pod("llm-70b-worker-3", "gpu-node-3")
    out = restarter.restart(plan)
    assert not out.changed and "already gone or replaced" in out.detail
    assert "deletionTimestamp" not in fake.pods[(NS, "llm-70b-worker-3")]["metadata"]


def test_dry_run_needs_no_cluster_and_forbidden_is_a_configuration_error(
    api: tuple[FakeKubeWithPods, str], tmp_path: Path
) -> None:
    fake, url = api
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        h = actuator(None, led, rl).handle(command())
        assert h.decision == "dry_run"
        [row] = rl.entries()
        assert row.status == "dry_run"
        assert "delete the pods job-name=llm-70b on node gpu-node-3" in row.detail
    assert fake.requests == [] and fake.pod_requests == []
    rs = RestartSettings(jobs=("llm-*",), execute=True)
    restarter = KubernetesRestarter(rs, KubernetesSettings(), ApiClient(Configuration(host=url)))
    fake.forbidden = True
    with pytest.raises(ActuatorConfigError, match="rbac-actuator-restart.yaml"):
        restarter.plan(command(), live=True)


def test_rbac_restart_manifest_grants_exactly_what_the_restarter_calls(
    api: tuple[FakeKubeWithPods, str], tmp_path: Path
) -> None:
    fake, url = api
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        actuator(url, led, rl).handle(command())
    verbs = {("GET", False): "list", ("DELETE", True): "delete"}
    used = {("pods", verbs[(r["method"], r["path"].count("/") == 6)]) for r in fake.pod_requests}
    manifest = Path(__file__).parents[2] / "compose" / "k8s" / "rbac-actuator-restart.yaml"
    granted: set[tuple[str, str]] = set()
    namespaces = set()
    for doc in yaml.safe_load_all(manifest.read_text()):
        namespaces.add(doc["metadata"].get("namespace"))
        for rule in doc.get("rules", []):
            assert rule["apiGroups"] == [""]
            granted |= {(res, v) for res in rule["resources"] for v in rule["verbs"]}
    assert used == granted == {("pods", "list"), ("pods", "delete")}
    assert namespaces == {RestartSettings().namespace}  # a Role, never cluster-wide
