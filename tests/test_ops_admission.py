"""The actuator's admission policy (compose/k8s/admission-actuator.yaml).

No API server runs here, so what can be checked is checked: the manifest parses, names
the service account of the RBAC file and the backend's taint key and condition type, and
its CEL expressions, evaluated with cel-python on sample old/new Node objects, let the
actuator's own changes through (built with the backend's own ``upsert_taint``) and refuse
a label, annotation, other taint, uncordon, other spec field or other status change.
cel-python evaluates untyped JSON; the API server type-checks against the Node schema
as well, which is not tried here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from sinks.actuator.config import KubernetesSettings
from sinks.actuator.kubernetes_backend import upsert_taint

celpy = pytest.importorskip("celpy", reason="cel-python is a test dependency (./run test)")

K8S = Path(__file__).resolve().parents[1] / "compose" / "k8s"
SETTINGS = KubernetesSettings()


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _policy() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = {d["kind"]: d for d in _docs("admission-actuator.yaml")}
    return docs["ValidatingAdmissionPolicy"], docs["ValidatingAdmissionPolicyBinding"]


def _actuator_user() -> str:
    rbac = _docs("rbac-actuator.yaml")
    (sa,) = [d for d in rbac if d["kind"] == "ServiceAccount"]
    (crb,) = [d for d in rbac if d["kind"] == "ClusterRoleBinding"]
    (subject,) = crb["subject" + "s"]
    assert (subject["name"], subject["namespace"]) == (
        sa["metadata"]["name"],
        sa["metadata"]["namespace"],
    )
    return f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"


ENV = celpy.Environment()


def _eval(expr: str, activation: dict[str, Any]) -> Any:
    return ENV.program(ENV.compile(expr)).evaluate(activation)


class Admission:
    """The policy as the API server applies it: match, variables in order, validations."""

    def __init__(self) -> None:
        self.policy, self.binding = _policy()

    def decide(self, old: dict, new: dict, *, sub: str = "", user: str | None = None) -> list[str]:
        """Messages of the failed validations (empty: admitted); ["not matched"] when the
        policy does not apply to the request."""
        spec = self.policy["spec"]
        request = {"userInfo": {"username": user or _actuator_user()}, "subResource": sub}
        act: dict[str, Any] = {
            "object": celpy.json_to_cel(new),
            "oldObject": celpy.json_to_cel(old),
            "request": celpy.json_to_cel(request),
        }
        if not all(bool(_eval(m["expression"], act)) for m in spec["matchConditions"]):
            return ["not matched"]
        variables = celpy.celtypes.MapType()
        act["variables"] = variables
        for v in spec["variables"]:
            variables[celpy.celtypes.StringType(v["name"])] = _eval(v["expression"], act)
        return [v["message"] for v in spec["validations"] if not bool(_eval(v["expression"], act))]


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
NODE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {
        "name": "node-002",
        "labels": {"kubernetes.io/hostname": "node-002", "gpu": "h100"},
        "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        "resourceVersion": "41",
    },
    "spec": {"podCIDR": "10.0.2.0/24", "providerID": "metal://node-002", "taints": [GPU_TAINT]},
    "status": {
        "capacity": {"nvidia.com/gpu": "8"},
        "allocatable": {"nvidia.com/gpu": "8"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        "nodeInfo": {"kubeletVersion": "v1.31.0"},
    },
}


def _cordoned(node: dict, fault: str = "noncomm_hang", effect: str = "NoExecute") -> dict:
    """What the Kubernetes backend writes: its taint upserted, spec.unschedulable true."""
    new = copy.deepcopy(node)
    new["spec"]["taints"], _ = upsert_taint(
        node["spec"].get("taints", []), SETTINGS.taint_key, fault, effect
    )
    new["spec"]["unschedulable"] = True
    new["metadata"]["resourceVersion"] = "42"  # the server bumps it on every write
    return new


def _edit(node: dict, path: str, value: Any) -> dict:
    new = copy.deepcopy(node)
    *parents, last = path.split(".")
    at = new
    for p in parents:
        at = at.setdefault(p, {})
    if value is None:
        at.pop(last, None)
    else:
        at[last] = value
    return new


def test_manifest_names_the_rbac_service_account_and_the_backend_defaults() -> None:
    policy, binding = _policy()
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert set(rule["resources"]) == {"nodes", "nodes/status"} and rule["operations"] == ["UPDATE"]
    (match,) = policy["spec"]["matchConditions"]
    assert f"'{_actuator_user()}'" in match["expression"]
    variables = {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
    assert variables["taintKey"] == f"'{SETTINGS.taint_key}'"
    assert variables["conditionType"] == f"'{SETTINGS.condition_type}'"


def test_the_actuators_own_changes_are_admitted() -> None:
    adm = Admission()
    cordon = _cordoned(NODE, effect="NoSchedule")
    assert adm.decide(NODE, cordon) == []
    # escalation to NoExecute with a new fault: both taints of ours carry it
    assert adm.decide(cordon, _cordoned(cordon, "slow_nic", "NoExecute")) == []
    # a node without any taint yet
    assert (
        adm.decide(_edit(NODE, "spec.taints", None), _cordoned(_edit(NODE, "spec.taints", None)))
        == []
    )
    # its condition through nodes/status (the kubelet's Ready stays as it is)
    mine = {"type": SETTINGS.condition_type, "status": "True", "reason": "NoncommHang"}
    conds = [*NODE["status"]["conditions"], mine]
    assert adm.decide(NODE, _edit(NODE, "status.conditions", conds), sub="status") == []


CORDONED = _cordoned(NODE)
ALIEN_TAINT = {"key": "example.com/x", "effect": "NoExecute"}
REFUSED: dict[str, tuple[str, Any, str]] = {
    "label changed": ("metadata.labels", {**NODE["metadata"]["labels"], "gpu": "none"}, "labels"),
    "annotation changed": ("metadata.annotations", {"x": "y"}, "annotations"),
    "annotations removed": ("metadata.annotations", None, "annotations"),
    "other taint removed": ("spec.taints", CORDONED["spec"]["taints"][1:], "own key"),
    "other taint added": ("spec.taints", [*CORDONED["spec"]["taints"], ALIEN_TAINT], "own key"),
    "uncordon": ("spec.unschedulable", False, "never uncordon"),
    "providerID changed": ("spec.providerID", "metal://elsewhere", "spec.unschedulable"),
    "podCIDR removed": ("spec.podCIDR", None, "spec.unschedulable"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_anything_else_on_the_node_is_refused(case: str) -> None:
    path, value, message = REFUSED[case]
    assert CORDONED["spec"]["taints"][0] == GPU_TAINT
    # refused also next to a legitimate cordon
    refused = Admission().decide(CORDONED, _edit(CORDONED, path, value))
    assert refused and all(message in m for m in refused), refused


@pytest.mark.parametrize(
    "change",
    [
        lambda n: _edit(n, "status.conditions", [{"type": "Ready", "status": "False"}]),
        lambda n: _edit(n, "status.capacity", {"nvidia.com/gpu": "0"}),
        lambda n: _edit(n, "metadata.labels", {}),
    ],
)
def test_status_writes_other_than_its_condition_are_refused(change: Any) -> None:
    assert Admission().decide(NODE, change(NODE), sub="status")


def test_other_users_are_not_matched() -> None:
    changed = _edit(NODE, "metadata.labels", {"gpu": "none"})
    assert Admission().decide(NODE, changed, user="system:node:node-002") == ["not matched"]
