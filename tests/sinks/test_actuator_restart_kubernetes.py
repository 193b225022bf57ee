"""Restart after isolation on Kubernetes, against a real kube-apiserver with the Job
controller, the scheduler and the disruption controller running (tests/k8s_fixture.py).

The actuator runs as its service account with rbac-actuator.yaml and
rbac-actuator-restart.yaml applied (the latter's Role copied into the test's namespace,
as the manifest tells a user to do). There is no kubelet: the tests play its part (a
pod's phase, a deleted pod finished), and say so where they do. The loopback stand-in is
not used here: everything below is what the real server and controllers do.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from sinks.actuator.backends import ActuatorConfigError, TransientActionError
from sinks.actuator.config import ActuatorConfig, KubernetesSettings, RestartSettings
from sinks.actuator.consumer import Actuator
from sinks.actuator.kubernetes_backend import KubernetesBackend, load_api_client
from sinks.actuator.ledger import Ledger
from sinks.actuator.restart import RestartHook, RestartLog
from sinks.actuator.restart_kubernetes import KubernetesRestarter
from streams.commands import IsolationCommand
from tests.k8s_fixture import K8S, KubeCluster

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(240)]


def command(host: str, job: str, **kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id=f"c4-{uuid.uuid4().hex[:8]}",
        ts_us=1,
        job=job,
        host=host,
        gpu=2,
        fault="straggler",
        action="cordon",
        confidence=0.93,
        reason=f"{host} GPU 2 arrived last in 40 of 40 all-reduces.",
        evidence={},
        dry_run=False,  # the worker decided to act (a command without it is a dry run)
    )
    base.update(kw)
    return IsolationCommand(**base)


class Setup:
    """A namespace with the restart Role, two labelled nodes, and the actuator's client."""

    def __init__(self, kube: KubeCluster, *, rbac: bool = True) -> None:
        self.kube = kube
        self.ns = kube.namespace("restart")
        if rbac:
            for doc in yaml.safe_load_all((K8S / "rbac-actuator-restart.yaml").read_text()):
                doc["metadata"]["namespace"] = self.ns
                kube.apply(doc)
        self.pool = self.ns  # nodes of this test only: pods select them by this label
        self.nodes = [f"{self.ns}-a", f"{self.ns}-b"]
        for n in self.nodes:
            kube.add_node(n)
            kube.kubectl("label", "node", n, f"c4stream-test/pool={self.pool}")
        settings = KubernetesSettings(kubeconfig=str(kube.actuator_kubeconfig))
        self.settings = settings
        self.client = load_api_client(settings)

    def restarter(self, **kw: Any) -> KubernetesRestarter:
        rs = RestartSettings(**{"jobs": ("llm-*",), "execute": True, "namespace": self.ns, **kw})
        return KubernetesRestarter(rs, self.settings, self.client)

    def actuator(self, led: Ledger, rl: RestartLog, restarter: KubernetesRestarter) -> Actuator:
        hook = RestartHook(restarter.s, restarter, rl, attempts=1, retry_backoff_s=0.1)
        be = KubernetesBackend(self.settings, self.client)
        return Actuator(ActuatorConfig(execute=True), be, led, restart=hook)

    def job(self, name: str, *, ignore_disruptions: bool = True) -> None:
        self.kube.need_controllers()  # the Job controller and the scheduler
        spec: dict[str, Any] = {
            "parallelism": 1,
            "completions": 1,
            "backoffLimit": 0,  # any failure counted fails the job at once
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"c4stream-test/pool": self.pool},
                    "containers": [{"name": "trainer", "image": "example.com/train:1"}],
                }
            },
        }
        if ignore_disruptions:  # as in compose/k8s/example-training-job.yaml
            spec["podFailurePolicy"] = {
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
            }
        self.kube.create(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": name, "namespace": self.ns},
                "spec": spec,
            }
        )

    def pods(self, job: str) -> list[dict[str, Any]]:
        return self.kube.items("pods", "-n", self.ns, "-l", f"job-name={job}")

    def running_pod(self, job: str, not_uid: str | None = None) -> dict[str, Any]:
        """The job's pod once scheduled, marked Running and Ready (the kubelet's part)."""

        def scheduled() -> dict[str, Any] | None:
            return next(
                (
                    p
                    for p in self.pods(job)
                    if p["spec"].get("nodeName")
                    and p["metadata"]["uid"] != not_uid
                    and not p["metadata"].get("deletionTimestamp")
                ),
                None,
            )

        pod = self.kube.wait(f"a scheduled pod of job {job}", scheduled)
        self.kube.set_pod_phase(
            self.ns, pod["metadata"]["name"], "Running",
            conditions=[{"type": "Ready", "status": "True"}],
        )  # fmt: skip
        return dict(pod)

    def kubelet_stops(self, pod: dict[str, Any]) -> None:
        """What the kubelet does to an evicted or deleted pod: containers stopped
        (phase Failed, exit 137), then the pod object finished."""
        name = pod["metadata"]["name"]
        self.kube.set_pod_phase(
            self.ns, name, "Failed",
            containerStatuses=[{
                "name": "trainer", "image": "example.com/train:1", "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {"exitCode": 137, "reason": "Error"}},
            }],
        )  # fmt: skip

    def job_status(self, name: str) -> dict[str, Any]:
        return dict(self.kube.get("job", name, self.ns).get("status") or {})


def _failed(status: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Failed" and c["status"] == "True" for c in status.get("conditions") or []
    )


def test_eviction_restarts_the_pod_on_a_healthy_node_without_failing_the_job(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    s = Setup(kube_cluster)
    job = "llm-evict"
    s.job(job)
    pod = s.running_pod(job)
    bad = pod["spec"]["nodeName"]
    (spare,) = set(s.nodes) - {bad}
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        h = s.actuator(led, rl, s.restarter()).handle(command(bad, job))
        assert (h.decision, h.status) == ("act", "done")
        [row] = rl.entries()
    assert row.status == "done" and row.target == pod["metadata"]["name"], row.detail
    assert "evicted pod(s)" in row.detail
    assert kube_cluster.get("node", bad)["spec"]["unschedulable"] is True
    evicted = kube_cluster.get("pod", pod["metadata"]["name"], s.ns)
    assert evicted["metadata"].get("deletionTimestamp")  # the Eviction API deleted it
    [cond] = [c for c in evicted["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert (cond["status"], cond["reason"]) == ("True", "EvictionByEvictionAPI")
    s.kubelet_stops(evicted)
    new = s.running_pod(job, not_uid=pod["metadata"]["uid"])  # the Job controller's replacement
    assert new["spec"]["nodeName"] == spare  # the scheduler kept off the cordoned node
    status = s.job_status(job)
    assert not _failed(status) and not status.get("failed"), status  # backoffLimit 0 untouched


def test_a_plain_delete_would_have_failed_the_job(kube_cluster: KubeCluster) -> None:
    """The contrast, same job and cluster: ``method = "delete"`` (what c4stream did before)
    spends the Job's retry; with backoffLimit 0 the job fails. (The actuator's account
    has no delete on pods: the administrator's client deletes here.)"""
    s = Setup(kube_cluster)
    job = "llm-delete"
    s.job(job)
    pod = s.running_pod(job)
    rs = RestartSettings(jobs=("llm-*",), execute=True, namespace=s.ns, method="delete")
    admin = load_api_client(KubernetesSettings(kubeconfig=str(kube_cluster.kubeconfig)))
    restarter = KubernetesRestarter(rs, s.settings, admin)
    plan = restarter.plan(command(pod["spec"]["nodeName"], job), live=True)
    assert "deleted pod(s)" in restarter.restart(plan).detail
    gone = kube_cluster.get("pod", pod["metadata"]["name"], s.ns)
    assert not [
        c for c in gone["status"].get("conditions") or [] if c["type"] == "DisruptionTarget"
    ]
    s.kubelet_stops(gone)
    status = kube_cluster.wait(f"job {job} failed", lambda: _failed(st := s.job_status(job)) and st)
    assert any(c.get("reason") == "BackoffLimitExceeded" for c in status["conditions"])


def test_a_pod_disruption_budget_holds_the_eviction_back(kube_cluster: KubeCluster) -> None:
    s = Setup(kube_cluster)
    job = "llm-pdb"
    s.job(job)
    pod = s.running_pod(job)
    kube_cluster.create(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": job, "namespace": s.ns},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"job-name": job}}},
        }
    )
    kube_cluster.wait(
        "the disruption controller's PDB status",
        lambda: (kube_cluster.get("pdb", job, s.ns).get("status") or {}).get("currentHealthy") == 1,
    )
    restarter = s.restarter()
    plan = restarter.plan(command(pod["spec"]["nodeName"], job), live=True)
    with pytest.raises(TransientActionError, match="429.*PodDisruptionBudget"):
        restarter.restart(plan)
    assert not kube_cluster.get("pod", pod["metadata"]["name"], s.ns)["metadata"].get(
        "deletionTimestamp"
    )


def _bare_pod(s: Setup, name: str, job: str, node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "example.com/x:1"}]}
    if node:
        spec["nodeName"] = node
    else:  # fits no node: stays Pending
        spec["nodeSelector"] = {"c4stream-test/pool": "nowhere"}
    return s.kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": s.ns, "labels": {"job-name": job}},
            "spec": spec,
        }
    )


def test_pending_or_terminating_pods_mean_a_restart_is_under_way(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    s = Setup(kube_cluster)
    job = "llm-busy"
    _bare_pod(s, "llm-busy-0", job, s.nodes[0])
    s.kube.set_pod_phase(s.ns, "llm-busy-0", "Running")
    _bare_pod(s, "llm-busy-1", job, None)
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        s.actuator(led, rl, s.restarter()).handle(command(s.nodes[0], job))
        [row] = rl.entries()
    assert row.status == "skipped" and "llm-busy-1 pending" in row.detail, row.detail
    assert not kube_cluster.get("pod", "llm-busy-0", s.ns)["metadata"].get("deletionTimestamp")


def test_a_replacement_pod_with_the_same_name_is_never_evicted(
    kube_cluster: KubeCluster,
) -> None:
    s = Setup(kube_cluster)
    job = "llm-same"
    _bare_pod(s, "llm-same-0", job, s.nodes[0])
    s.kube.set_pod_phase(s.ns, "llm-same-0", "Running")
    restarter = s.restarter()
    plan = restarter.plan(command(s.nodes[0], job), live=True)
    # between plan and eviction the pod was replaced by one of the same name (a new uid)
    s.kube.finish_pod(s.ns, "llm-same-0")
    s.kube.wait(
        "the old pod gone",
        lambda: s.kube.kubectl("get", "pod", "llm-same-0", "-n", s.ns, check=False).returncode,
    )
    new = _bare_pod(s, "llm-same-0", job, s.nodes[0])
    out = restarter.restart(plan)
    assert not out.changed and "already gone or replaced" in out.detail
    got = kube_cluster.get("pod", "llm-same-0", s.ns)
    assert got["metadata"]["uid"] == new["metadata"]["uid"]
    assert not got["metadata"].get("deletionTimestamp")


def test_without_the_restart_role_it_is_a_configuration_error(kube_cluster: KubeCluster) -> None:
    s = Setup(kube_cluster, rbac=False)
    with pytest.raises(ActuatorConfigError, match="rbac-actuator-restart.yaml"):
        s.restarter().plan(command(s.nodes[0], "llm-x"), live=True)
    with pytest.raises(ActuatorConfigError, match="create pods/eviction in namespace"):
        s.restarter().check()


@pytest.mark.timeout(30)
def test_dry_run_needs_no_cluster(tmp_path: Path) -> None:
    rs = RestartSettings(jobs=("llm-*",), execute=True)
    restarter = KubernetesRestarter(rs, KubernetesSettings(), None)
    ledger = tmp_path / "ledger.sqlite3"
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        hook = RestartHook(rs, restarter, rl)
        be = KubernetesBackend(KubernetesSettings(), None)
        h = Actuator(ActuatorConfig(), be, led, restart=hook).handle(command("gpu-node-3", "llm-7"))
        assert h.decision == "dry_run"
        [row] = rl.entries()
    assert row.status == "dry_run"
    assert "evict the pods job-name=llm-7 on node gpu-node-3" in row.detail
