"""The actuator's admission policy (compose/k8s/admission-actuator.yaml) on a real
kube-apiserver, tested for what it says.

Every forbidden change, tried as the actuator's service account, must be refused with
the POLICY'S OWN MESSAGE (HTTP 403, ``ValidatingAdmissionPolicy '…' … denied request:
<message>``): an evaluation error ("no such key") would be refused too under
``failurePolicy: Fail``, but as a 422 with the error's text, and admitted under
``Ignore``; asserting the message under both failure policies means only a validation
that really evaluated to false can pass these tests. Every change the backend makes is
admitted under both. The API server's type check (status.typeChecking, written by
kube-controller-manager) must report no warning.

To know the failure policy in force is the one just set, a canary policy with the same
failurePolicy and an expression that always errors is probed until the API server
answers as that failure policy says (refused for Fail, admitted for Ignore).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from sinks.actuator.config import KubernetesSettings
from sinks.actuator.kubernetes_backend import (
    KubernetesBackend,
    api_message,
    load_api_client,
    raw_call,
)
from streams.commands import IsolationCommand
from tests.k8s_fixture import K8S, KubeCluster

pytestmark = pytest.mark.timeout(300)

NODE_POLICY = "c4stream-actuator-nodes"
DRA_POLICY = "c4stream-actuator-devicetaints"
KEY = "c4stream.io/fault"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
OTHER_TAINT = {"key": "example.com/maintenance", "value": "planned", "effect": "NoSchedule"}
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"

MSG_META = "the c4stream actuator may not change a node's labels, annotations"
MSG_TAINTS = "the c4stream actuator may change only taints with its own key"
MSG_UNCORDON = "the c4stream actuator may cordon a node, never uncordon it"
MSG_SPEC = "the c4stream actuator may change only spec.unschedulable and its own taints"
MSG_STATUS = "the c4stream actuator may change only its own node condition"
MSG_ONE_DEVICE = "the c4stream actuator may taint only one device"
MSG_DEVICE_KEY = "the c4stream actuator may set only its own taint key"
MSG_OWN_RULES = "the c4stream actuator may change only its own DeviceTaintRules"
MSG_WEAKEN = "the c4stream actuator may not weaken a NoExecute device taint"


def _policies() -> dict[str, dict[str, Any]]:
    docs = yaml.safe_load_all((K8S / "admission-actuator.yaml").read_text())
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}


def test_the_policy_names_the_rbac_service_account_and_the_backend_defaults() -> None:
    """Static: what must agree with rbac-actuator.yaml and KubernetesSettings' defaults."""
    rbac = list(yaml.safe_load_all((K8S / "rbac-actuator.yaml").read_text()))
    (sa,) = [d for d in rbac if d["kind"] == "ServiceAccount"]
    user = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    s = KubernetesSettings()
    for policy in _policies().values():
        assert policy["spec"]["failurePolicy"] == "Fail"
        (match,) = policy["spec"]["matchConditions"]
        assert f"'{user}'" in match["expression"]
        variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
        assert variables["taintKey"] == f"'{s.taint_key}'"
    nodes = {v["name"]: v["expression"] for v in _policies()[NODE_POLICY]["spec"]["variables"]}
    assert nodes["conditionType"] == f"'{s.condition_type}'"


# ------------------------------------------------------------------ on the real server


def _set_failure_policy(kube: KubeCluster, fp: str) -> None:
    for name in (NODE_POLICY, DRA_POLICY, "c4stream-test-canary"):
        kube.kubectl(
            "patch", "validatingadmissionpolicy", name, "--type=merge",
            "-p", json.dumps({"spec": {"failurePolicy": fp}}),
        )  # fmt: skip


def _canary(kube: KubeCluster) -> str:
    """A node and a policy whose only validation always fails to evaluate."""
    if kube.kubectl("get", "node", "c4-canary", check=False).returncode != 0:
        kube.add_node("c4-canary")  # first: the policy would refuse the node's own set-up
    kube.apply(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": "c4stream-test-canary"},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["UPDATE"],
                            "resources": ["nodes"],
                        }
                    ]
                },
                "matchConditions": [
                    {"name": "canary", "expression": "object.metadata.name == 'c4-canary'"}
                ],
                "validations": [{"expression": "object.metadata.labels['no-such-label'] == 'x'"}],
            },
        }
    )
    kube.apply(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": "c4stream-test-canary"},
            "spec": {"policyName": "c4stream-test-canary", "validationActions": ["Deny"]},
        }
    )
    return "c4-canary"


def _in_force(kube: KubeCluster, canary: str, fp: str) -> None:
    def probe() -> bool:
        p = kube.kubectl(
            "annotate", "node", canary, f"probe={uuid.uuid4().hex[:6]}", "--overwrite",
            check=False,
        )  # fmt: skip
        return (p.returncode == 0) == (fp == "Ignore")

    kube.wait(f"failurePolicy {fp} in force (canary)", probe, timeout=60, every=0.5)


@pytest.fixture(scope="module", params=["Fail", "Ignore"])
def failure_policy(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    fp = str(request.param)
    canary = _canary(kube_cluster)
    _set_failure_policy(kube_cluster, fp)
    _in_force(kube_cluster, canary, fp)
    yield fp
    _set_failure_policy(kube_cluster, "Fail")
    _in_force(kube_cluster, canary, "Fail")


class Actor:
    """Raw requests as the actuator's service account (what a stolen token could send)."""

    def __init__(self, kube: KubeCluster) -> None:
        self.settings = KubernetesSettings(kubeconfig=str(kube.actuator_kubeconfig))
        self.client = load_api_client(self.settings)

    def send(self, method: str, path: str, body: Any, ctype: str = "") -> tuple[int, str]:
        from kubernetes.client.exceptions import ApiException

        ctype = ctype or (MERGE if method == "PATCH" else "application/json")
        try:
            raw_call(self.client, method, path, body=body, content_type=ctype, timeout=10)
        except ApiException as err:
            return int(err.status or 0), api_message(err)
        return 200, ""

    def backend(self, **kw: Any) -> KubernetesBackend:
        s = KubernetesSettings(kubeconfig=self.settings.kubeconfig, **kw)
        return KubernetesBackend(s, self.client)


def command(host: str, **kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id=f"c4-{uuid.uuid4().hex[:8]}", ts_us=1, job="llm-70b", host=host, gpu=2,
        fault="straggler", action="cordon", confidence=0.9, reason="GPU 2 arrived last.",
        evidence={}, dry_run=False,
    )  # fmt: skip
    base.update(kw)
    return IsolationCommand(**base)


def _refused(got: tuple[int, str], policy: str, message: str) -> None:
    status, text = got
    assert status == 403, got
    assert f"ValidatingAdmissionPolicy '{policy}'" in text and message in text, text


@pytest.fixture
def cordoned(kube_cluster: KubeCluster, failure_policy: str) -> str:
    """A node with two other owners' taints, cordoned by the actuator (admitted)."""
    node = f"adm-{failure_policy.lower()}-{uuid.uuid4().hex[:6]}"
    kube_cluster.add_node(node, taints=[GPU_TAINT, OTHER_TAINT])
    kube_cluster.kubectl("label", "node", node, "gpu=h100")
    kube_cluster.kubectl("annotate", "node", node, "example.com/owner=infra")
    out = Actor(kube_cluster).backend().apply(command(node))
    assert out.changed and "cordoned" in out.detail
    kube_cluster.settle_cordon(node)
    return node


@pytest.mark.kubernetes
def test_the_actuators_own_changes_are_admitted(
    kube_cluster: KubeCluster, cordoned: str, failure_policy: str
) -> None:
    kube, node = kube_cluster, cordoned
    be = Actor(kube).backend()
    be.apply(command(node, fault="slow_nic", action="cordon_and_taint", gpu=None, nic="mlx5_1"))
    got = kube.get("node", node)
    # (node.kubernetes.io/unschedulable: the node-lifecycle controller's mirror of the cordon)
    mirror = "node.kubernetes.io/unschedulable"
    assert [t["key"] for t in got["spec"]["taints"] if t["key"] != mirror] == [
        "nvidia.com/gpu", "example.com/maintenance", KEY, KEY,
    ]  # fmt: skip
    assert {t["value"] for t in got["spec"]["taints"] if t["key"] == KEY} == {"slow_nic"}
    conds = {c["type"]: c for c in got["status"]["conditions"]}
    assert conds["C4streamFaulty"]["reason"] == "SlowNic" and conds["Ready"]["status"] == "True"


@pytest.mark.kubernetes
@pytest.mark.parametrize(
    ("case", "patch", "message"),
    [
        ("uncordon", {"spec": {"unschedulable": False}}, MSG_UNCORDON),
        ("another owner's taint", "add-evil", MSG_TAINTS),
        ("remove another owner's taint", "drop-gpu", MSG_TAINTS),
        ("reorder other taints", "swap", MSG_TAINTS),
        ("providerID", {"spec": {"providerID": "metal://elsewhere"}}, MSG_SPEC),
        ("labels", {"metadata": {"labels": {"gpu": "none"}}}, MSG_META),
        ("annotations", {"metadata": {"annotations": {"x": "y"}}}, MSG_META),
    ],
)
def test_forbidden_node_changes_are_refused_with_the_policys_message(
    kube_cluster: KubeCluster, cordoned: str, failure_policy: str, case: str, patch: Any,
    message: str,
) -> None:  # fmt: skip
    kube, node = kube_cluster, cordoned
    before = kube.get("node", node)
    taints = before["spec"]["taints"]
    if patch == "add-evil":
        patch = {
            "spec": {"taints": [*taints, {"key": "evil.example.com/x", "effect": "NoExecute"}]}
        }
    elif patch == "drop-gpu":
        patch = {"spec": {"taints": [t for t in taints if t["key"] != "nvidia.com/gpu"]}}
    elif patch == "swap":
        patch = {"spec": {"taints": [taints[1], taints[0], *taints[2:]]}}
    _refused(Actor(kube).send("PATCH", f"/api/v1/nodes/{node}", patch), NODE_POLICY, message)
    after = kube.get("node", node)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


@pytest.mark.kubernetes
@pytest.mark.parametrize(
    ("case", "patch"),
    [
        ("another condition", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
        ("capacity", {"status": {"capacity": {"nvidia.com/gpu": "0"}}}),
        ("allocatable", {"status": {"allocatable": {"nvidia.com/gpu": "7"}}}),
    ],
)
def test_forbidden_status_changes_are_refused_with_the_policys_message(
    kube_cluster: KubeCluster, cordoned: str, failure_policy: str, case: str, patch: Any
) -> None:
    kube, node = kube_cluster, cordoned
    got = Actor(kube).send("PATCH", f"/api/v1/nodes/{node}/status", patch, STRATEGIC)
    _refused(got, NODE_POLICY, MSG_STATUS)
    status = kube.get("node", node)["status"]
    assert status["capacity"]["nvidia.com/gpu"] == status["allocatable"]["nvidia.com/gpu"] == "8"


def _rule(name: str, *, key: str = KEY, effect: str = "NoSchedule", **sel: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": {"deviceSelector": sel, "taint": {"key": key, "value": "x", "effect": effect}},
    }


@pytest.mark.kubernetes
def test_device_taint_rules_only_for_one_device_with_its_own_key(
    kube_cluster: KubeCluster, failure_policy: str
) -> None:
    kube = kube_cluster
    if not kube.served("resource.k8s.io/v1", "devicetaintrules"):
        pytest.skip(f"kube-apiserver {kube.version} serves no resource.k8s.io/v1 devicetaintrules")
    actor, tag = Actor(kube), f"{failure_policy.lower()}-{uuid.uuid4().hex[:6]}"
    one = {"driver": "gpu.nvidia.com", "pool": f"n-{tag}", "device": "gpu-1"}
    post = "/apis/resource.k8s.io/v1/devicetaintrules"
    # refused: every device of the cluster (empty selector), a whole pool, another key, None
    _refused(actor.send("POST", post, _rule(f"all-{tag}")), DRA_POLICY, MSG_ONE_DEVICE)
    pool = {k: v for k, v in one.items() if k != "device"}
    _refused(actor.send("POST", post, _rule(f"pool-{tag}", **pool)), DRA_POLICY, MSG_ONE_DEVICE)
    other_key = _rule(f"key-{tag}", key="example.com/x", **one)
    _refused(actor.send("POST", post, other_key), DRA_POLICY, MSG_DEVICE_KEY)
    no_effect = _rule(f"none-{tag}", effect="None", **one)
    _refused(actor.send("POST", post, no_effect), DRA_POLICY, MSG_DEVICE_KEY)
    # admitted: the actuator's own rule for one device
    mine = f"mine-{tag}"
    assert actor.send("POST", post, _rule(mine, effect="NoExecute", **one)) == (200, "")
    # refused on update: re-pointed at another device, weakened, someone else's rule
    repoint = {"spec": {"deviceSelector": {"device": "gpu-5"}}}
    _refused(actor.send("PATCH", f"{post}/{mine}", repoint), DRA_POLICY, MSG_OWN_RULES)
    weaken = {"spec": {"taint": {"effect": "NoSchedule"}}}
    _refused(actor.send("PATCH", f"{post}/{mine}", weaken), DRA_POLICY, MSG_WEAKEN)
    kube.create(_rule(f"admin-{tag}", key="example.com/maintenance", **one))  # an admin's
    take = {"spec": {"taint": {"key": KEY}}}
    _refused(actor.send("PATCH", f"{post}/admin-{tag}", take), DRA_POLICY, MSG_OWN_RULES)
    # admitted: its own rule's value changed, effect kept
    assert actor.send("PATCH", f"{post}/{mine}", {"spec": {"taint": {"value": "y"}}}) == (200, "")


@pytest.mark.kubernetes
def test_the_policies_type_check_without_warnings(kube_cluster: KubeCluster) -> None:
    kube = kube_cluster
    kube.need_controllers()  # kube-controller-manager writes status.typeChecking

    def checked() -> dict[str, Any] | None:
        out = {}
        for name in (NODE_POLICY, DRA_POLICY):
            st = kube.get("validatingadmissionpolicy", name).get("status") or {}
            if "typeChecking" not in st:
                return None
            out[name] = st["typeChecking"]
        return out

    typed = kube.wait("status.typeChecking of both policies", checked, timeout=120)
    assert all(not t.get("expressionWarnings") for t in typed.values()), typed
