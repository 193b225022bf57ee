"""The Kubernetes backend against a real kube-apiserver (tests/k8s_fixture.py).

The actuator runs as its service account (a token of
``system:serviceaccount:c4stream:c4stream-actuator``) with the shipped RBAC
(compose/k8s/rbac-actuator*.yaml) and admission policy (admission-actuator.yaml)
applied, as a user would deploy it; the tests read the results as the administrator.
A 409 Conflict race is made real: a wrapped read lets the administrator change the node
between the backend's read and its write. Only failures a real server cannot be made to
produce on demand (5xx, a rejected Event) use the loopback stand-in of
``tests/sinks/kube_standin.py``, at the end of this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from sinks.actuator.backends import (
    ActuatorConfigError,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.config import ActuatorConfig, KubernetesSettings, RestartSettings
from sinks.actuator.consumer import Actuator
from sinks.actuator.kubernetes_backend import KubernetesBackend, load_api_client
from sinks.actuator.ledger import Ledger
from sinks.actuator.restart_kubernetes import KubernetesRestarter
from streams.commands import IsolationCommand
from tests.k8s_fixture import K8S, KubeCluster
from tests.sinks.kube_standin import FakeKubeAPI, backend_for, serve, status

KEY = "c4stream.io/fault"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OTHER_TAINT = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}

real = pytest.mark.kubernetes
pytestmark = pytest.mark.timeout(180)


def unique(prefix: str = "gpu-node") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def actuator_backend(kube: KubeCluster, kubeconfig: Path | None = None, **kw: Any):
    s = KubernetesSettings(kubeconfig=str(kubeconfig or kube.actuator_kubeconfig), **kw)
    return KubernetesBackend(s, load_api_client(s))


def command(host: str, **kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id=f"c4-{uuid.uuid4().hex[:8]}",
        ts_us=1,
        job="llm-70b",
        host=host,
        gpu=2,
        fault="straggler",
        action="cordon",
        confidence=0.93,
        reason=f"{host} GPU 2 arrived last in 40 of 40 all-reduces (median +18 ms).",
        evidence={"comms": ["0xa"]},
        dry_run=False,  # absent means dry run
    )
    base.update(kw)
    return IsolationCommand(**base)


#: The node-lifecycle controller mirrors spec.unschedulable as this taint, a moment after a
#: cordon (one more owner's taint the backend's writes keep; the 409 retry covers the race).
MIRROR = "node.kubernetes.io/unschedulable"


def taints(kube: KubeCluster, node: str) -> list[dict[str, Any]]:
    return [
        {k: t[k] for k in ("key", "value", "effect") if k in t}
        for t in kube.get("node", node)["spec"].get("taints") or []
        if t["key"] != MIRROR
    ]


def node_events(kube: KubeCluster, node: str, ns: str = "default") -> list[dict[str, Any]]:
    """The actuator's Events on the node (kube-controller-manager posts its own, e.g.
    RegisteredNode)."""
    got = kube.items("events", "-n", ns, "--field-selector", f"involvedObject.name={node}")
    return [e for e in got if e.get("reportingComponent") == "c4stream-actuator"]


def condition(kube: KubeCluster, node: str, type_: str = "C4streamFaulty") -> dict[str, Any]:
    conds = kube.get("node", node)["status"].get("conditions") or []
    return next((c for c in conds if c["type"] == type_), {})


@real
def test_cordon_keeps_other_taints_sets_condition_and_posts_event(
    kube_cluster: KubeCluster,
) -> None:
    kube, node = kube_cluster, unique()
    kube.add_node(node, taints=[GPU_TAINT])
    cmd = command(node)
    out = actuator_backend(kube).apply(cmd)
    got = kube.get("node", node)
    assert out.changed and "cordoned" in out.detail
    assert got["spec"]["unschedulable"] is True
    ours_taint = {"key": KEY, "value": "straggler", "effect": "NoSchedule"}
    assert taints(kube, node) == [GPU_TAINT, ours_taint]
    ready = condition(kube, node, "Ready")
    assert ready["status"] == "True" and ready["reason"] == "KubeletReady"  # the kubelet's stays
    ours = condition(kube, node)
    assert (ours["status"], ours["reason"], ours["message"]) == ("True", "Straggler", cmd.reason)
    [ev] = node_events(kube, node)
    inv = ev["involvedObject"]
    assert inv["kind"] == "Node" and inv["uid"] == got["metadata"]["uid"]
    assert "namespace" not in ev["involvedObject"]  # in "default": kubectl describe node shows it
    assert ev["type"] == "Warning" and ev["reason"] == "Straggler"
    assert cmd.reason in ev["message"] and "gpu 2" in ev["message"]
    described = kube.kubectl("describe", "node", node).stdout
    assert "Straggler" in described and "C4streamFaulty" in described


@real
def test_a_taint_added_between_read_and_write_survives_the_retry(
    kube_cluster: KubeCluster,
) -> None:
    kube, node = kube_cluster, unique()
    kube.add_node(node, taints=[GPU_TAINT])
    be = actuator_backend(kube)
    reads: list[str] = []
    raced: list[dict[str, Any]] = []
    read = be._read

    def racing_read(name: str) -> dict[str, Any]:
        got = read(name)
        reads.append(got["metadata"]["resourceVersion"])
        if len(reads) == 1:  # another controller writes between our read and our write
            kube.kubectl("taint", "node", name, "example.com/maintenance=planned:NoSchedule")
            raced.extend(taints(kube, name))
        return got

    be._read = racing_read  # type: ignore[method-assign]
    be.apply(command(node))
    assert len(reads) == 2 and reads[0] != reads[1]  # the real server answered 409 once
    assert sorted(raced, key=str) == sorted([GPU_TAINT, OTHER_TAINT], key=str)
    ours = {"key": KEY, "value": "straggler", "effect": "NoSchedule"}
    assert taints(kube, node) == [*raced, ours]  # theirs as they left them, ours added
    assert kube.get("node", node)["spec"]["unschedulable"] is True


@real
def test_endless_conflicts_give_up_after_the_bound(kube_cluster: KubeCluster) -> None:
    kube, node = kube_cluster, unique()
    kube.add_node(node)
    be = actuator_backend(kube, conflict_retries=3)
    read, n = be._read, [0]

    def always_racing(name: str) -> dict[str, Any]:
        got = read(name)
        n[0] += 1
        kube.kubectl("taint", "node", name, f"other.example.com/t{n[0]}=x:NoSchedule")
        return got

    be._read = always_racing  # type: ignore[method-assign]
    with pytest.raises(TransientActionError, match="3 writes lost"):
        be.apply(command(node))
    assert n[0] == 3
    assert not kube.get("node", node)["spec"].get("unschedulable")
    assert not node_events(kube, node)  # no Event for an action that did not happen


@real
def test_repeat_is_a_no_op_and_a_new_fault_updates_our_taint_only(
    kube_cluster: KubeCluster,
) -> None:
    kube, node = kube_cluster, unique()
    kube.add_node(node, taints=[GPU_TAINT])
    be = actuator_backend(kube)
    cmd = command(node)
    assert be.apply(cmd).changed
    kube.settle_cordon(node)
    rv = kube.get("node", node)["metadata"]["resourceVersion"]
    again = be.apply(cmd)
    assert not again.changed and "nothing changed" in again.detail
    assert kube.get("node", node)["metadata"]["resourceVersion"] == rv  # not written
    be.apply(command(node, fault="slow_nic", action="cordon_and_taint", nic="mlx5_1", gpu=None))
    assert taints(kube, node) == [
        GPU_TAINT,
        {"key": KEY, "value": "slow_nic", "effect": "NoSchedule"},
        {"key": KEY, "value": "slow_nic", "effect": "NoExecute"},
    ]
    assert condition(kube, node)["reason"] == "SlowNic"
    assert len(node_events(kube, node)) == 2


@real
def test_restart_job_marks_the_node_without_cordoning(kube_cluster: KubeCluster) -> None:
    kube, node = kube_cluster, unique()
    kube.add_node(node, taints=[GPU_TAINT])
    actuator_backend(kube).apply(command(node, action="restart_job", fault="comm_hang"))
    got = kube.get("node", node)
    assert not got["spec"].get("unschedulable") and taints(kube, node) == [GPU_TAINT]
    assert condition(kube, node)["reason"] == "CommHang"
    assert len(node_events(kube, node)) == 1


@real
def test_error_policy(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    kube, node = kube_cluster, unique()
    with pytest.raises(PermanentActionError, match="No such node"):
        actuator_backend(kube).apply(command("ghost-node"))
    kube.add_node(node)
    kube.kubectl("create", "serviceaccount", "nobody", "-n", "c4stream", check=False)
    nobody = kube.token_kubeconfig("c4stream", "nobody", tmp_path / "nobody.kubeconfig")
    with pytest.raises(ActuatorConfigError, match="403.*rbac-actuator.yaml"):
        actuator_backend(kube, nobody).apply(command(node))
    assert not kube.get("node", node)["spec"].get("unschedulable")


@real
def test_dry_run_and_deny_never_write(kube_cluster: KubeCluster, tmp_path: Path) -> None:
    kube, node = kube_cluster, unique()
    kube.add_node(node)
    rv = kube.get("node", node)["metadata"]["resourceVersion"]
    be = actuator_backend(kube)
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        dry = Actuator(ActuatorConfig(), be, led).handle(command(node))
        denied = Actuator(ActuatorConfig(execute=True, deny=("gpu-node-*",)), be, led).handle(
            command(node)
        )
        own_dry = Actuator(ActuatorConfig(execute=True), be, led).handle(
            command(node, dry_run=True)
        )
        alert = Actuator(ActuatorConfig(execute=True), be, led).handle(
            command(node, action="alert_only")
        )
    assert (dry.decision, denied.decision, own_dry.decision, alert.decision) == (
        "dry_run",
        "denied",
        "dry_run",
        "alert_only",
    )
    assert "set spec.unschedulable=true" in dry.detail
    assert f"taint {KEY}=straggler:NoSchedule" in dry.detail
    assert kube.get("node", node)["metadata"]["resourceVersion"] == rv
    assert not node_events(kube, node)


@real
def test_events_in_another_namespace_pass_the_api_servers_rule(kube_cluster: KubeCluster) -> None:
    kube, node = kube_cluster, unique()
    kube.add_node(node)
    # What the RBAC file says to do when --event-namespace changes: its Role there.
    for doc in yaml.safe_load_all((K8S / "rbac-actuator.yaml").read_text()):
        if doc["kind"] in ("Role", "RoleBinding"):
            doc["metadata"]["namespace"] = "c4stream"
            kube.apply(doc)
    out = actuator_backend(kube, event_namespace="c4stream").apply(command(node))
    assert "Event not posted" not in out.detail
    [ev] = node_events(kube, node, "c4stream")
    assert ev["involvedObject"]["namespace"] == "c4stream"
    assert ev["involvedObject"]["kind"] == "Node" and ev["involvedObject"]["name"] == node


def _granted(*manifests: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/sub], verb) the manifests grant."""
    out: set[tuple[str, str, str]] = set()
    for name in manifests:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            for rule in (doc or {}).get("rules", []):
                out |= {
                    (g, r, v)
                    for g in rule["apiGroups"]
                    for r in rule["resources"]
                    for v in rule["verbs"]
                }
    return out


def _needed(perms: Any) -> set[tuple[str, str, str]]:
    return {
        (p.group, p.resource + (f"/{p.subresource}" if p.subresource else ""), p.verb)
        for p in perms
    }


def test_the_rbac_manifests_grant_exactly_what_the_code_asks_for() -> None:
    node = KubernetesBackend(KubernetesSettings(), None).needs()
    device = KubernetesBackend(KubernetesSettings(gpu_isolation="device"), None).needs()
    restart = KubernetesRestarter(RestartSettings(jobs=("x",)), KubernetesSettings(), None)
    assert _needed(node) == _granted("rbac-actuator.yaml")
    assert _needed(device) - _needed(node) == _granted("rbac-actuator-dra.yaml")
    assert _needed(restart.needs()) == _granted("rbac-actuator-restart.yaml")
    assert {p.manifest for p in device} == {
        "compose/k8s/rbac-actuator.yaml",
        "compose/k8s/rbac-actuator-dra.yaml",
    }


def _check(kube: KubeCluster, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``c4stream actuate --check`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "c4stream", "actuate", "--backend", "kubernetes",
         "--kubeconfig", str(kubeconfig), "--check", *args],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "KAFKA_BOOTSTRAP": "127.0.0.1:9"},
    )  # fmt: skip


@real
def test_check_verifies_every_permission_and_names_the_missing_manifest(
    kube_cluster: KubeCluster, tmp_path: Path
) -> None:
    kube = kube_cluster
    full = ("--restart-jobs", "llm-*", "--gpu-isolation", "device")
    ok = _check(kube, kube.actuator_kubeconfig, *full)
    assert ok.returncode == 0, ok.stderr
    for line in (
        "kubernetes: get nodes: allowed",
        "kubernetes: patch nodes/status: allowed",
        "kubernetes: create events in namespace default: allowed",
        "kubernetes: list resourceslices.resource.k8s.io: allowed",
        "kubernetes: create devicetaintrules.resource.k8s.io: allowed",
        "kubernetes: DRA device taints served (resource.k8s.io/v1 devicetaintrules)",
        "kubernetes restart: list pods in namespace default: allowed",
        "kubernetes restart: create pods/eviction in namespace default: allowed",
    ):
        assert line in ok.stdout, ok.stdout
    # A service account bound to rbac-actuator.yaml's roles only: restart and DRA missing.
    kube.kubectl("create", "serviceaccount", "partial", "-n", "c4stream", check=False)
    kube.kubectl(
        "create", "clusterrolebinding", "c4stream-partial", "--clusterrole=c4stream-actuator",
        "--serviceaccount=c4stream:partial", check=False,
    )  # fmt: skip
    kube.kubectl(
        "create", "rolebinding", "c4stream-partial-events", "-n", "default",
        "--role=c4stream-actuator-events", "--serviceaccount=c4stream:partial", check=False,
    )  # fmt: skip
    partial = kube.token_kubeconfig("c4stream", "partial", tmp_path / "partial.kubeconfig")
    node_only = _check(kube, partial)
    assert node_only.returncode == 0, node_only.stderr  # nodes only: enough
    no_dra = _check(kube, partial, "--gpu-isolation", "device")
    assert no_dra.returncode == 2
    assert "not allowed to list resourceslices.resource.k8s.io" in no_dra.stderr
    assert "apply compose/k8s/rbac-actuator-dra.yaml" in no_dra.stderr
    no_restart = _check(kube, partial, "--restart-jobs", "llm-*")
    assert no_restart.returncode == 2, no_restart.stdout
    assert "backend kubernetes ok" in no_restart.stdout
    assert "create pods/eviction in namespace default" in no_restart.stderr
    assert "apply compose/k8s/rbac-actuator-restart.yaml" in no_restart.stderr


# ------------------------------------------------ failure injection: the stand-in only


def test_a_rejected_event_does_not_fail_an_action_that_happened() -> None:
    """A 422 for the Event: the real server accepts the backend's Events, so injected."""
    fake = FakeKubeAPI()
    fake.add_node("gpu-node-3")
    passthrough = fake.handle

    def reject_events(method: str, path: str, ctype: str, body: Any, auth: str | None):
        if path.endswith("/events"):
            return status(422, "Invalid", "metadata.name: too long")
        return passthrough(method, path, ctype, body, auth)

    fake.handle = reject_events  # type: ignore[method-assign]
    with serve(fake) as url:
        out = backend_for(url).apply(command("gpu-node-3"))
    assert fake.nodes["gpu-node-3"]["spec"]["unschedulable"] is True
    assert "Event not posted" in out.detail and "too long" in out.detail


def test_server_errors_and_no_server_are_transient() -> None:
    """5xx (etcd timing out) cannot be asked of a real server; a closed port can, anywhere."""
    fake = FakeKubeAPI()
    fake.add_node("gpu-node-3")
    fake.fail_with = 503
    with serve(fake) as url, pytest.raises(TransientActionError, match="HTTP 503"):
        backend_for(url).apply(command("gpu-node-3"))
    closed = "http://127.0.0.1:9"  # discard port: nothing listens
    with pytest.raises(TransientActionError):
        backend_for(closed, request_timeout_s=2.0).apply(command("gpu-node-3"))


def test_kubeconfig_errors_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ActuatorConfigError, match="cannot load kubeconfig"):
        load_api_client(KubernetesSettings(kubeconfig=str(tmp_path / "missing")))
