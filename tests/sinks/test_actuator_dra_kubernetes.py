"""One bad GPU, not its node: DRA device taints on a real kube-apiserver 1.37.

The test makes what a DRA driver would publish for an 8-GPU node: a ResourceSlice of
driver ``gpu.nvidia.com`` with devices ``gpu-0`` … ``gpu-7`` (attribute ``index``) and a
DeviceClass. The actuator (its service account, rbac-actuator-dra.yaml and the
admission policy applied) isolates GPU 2 of a straggler; then eight pods each claim one
GPU on that node, and the real scheduler's DRA allocator places seven of them, none on
GPU 2, while the node stays schedulable.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from sinks.actuator.config import KubernetesSettings
from sinks.actuator.kubernetes_backend import (
    Device,
    KubernetesBackend,
    device_rule_name,
    load_api_client,
)
from streams.commands import IsolationCommand
from tests.k8s_fixture import KubeCluster

pytestmark = [pytest.mark.kubernetes, pytest.mark.timeout(240)]

DRIVER = "gpu.nvidia.com"
KEY = "c4stream.io/fault"


@pytest.fixture
def dra(kube_cluster: KubeCluster) -> KubeCluster:
    if not kube_cluster.served("resource.k8s.io/v1", "devicetaintrules"):
        pytest.skip(
            f"kube-apiserver {kube_cluster.version} does not serve resource.k8s.io/v1 "
            "devicetaintrules (GA and on by default from 1.37)"
        )
    kube_cluster.apply(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]},
        }
    )
    return kube_cluster


def gpu_node(kube: KubeCluster, gpus: int = 8) -> str:
    """A Ready node and the ResourceSlice its DRA driver would publish."""
    node = f"dra-node-{uuid.uuid4().hex[:6]}"
    kube.add_node(node)
    kube.create(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}"},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {
                        "name": f"gpu-{i}",
                        "attributes": {
                            "index": {"int": i},
                            "uuid": {"string": f"GPU-{node}-{i}"},
                        },
                    }
                    for i in range(gpus)
                ],
            },
        }
    )
    return node


def backend(kube: KubeCluster, **kw: Any) -> KubernetesBackend:
    s = KubernetesSettings(kubeconfig=str(kube.actuator_kubeconfig), gpu_isolation="device", **kw)
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
        evidence={},
        dry_run=False,
    )
    base.update(kw)
    return IsolationCommand(**base)


def rules_for(kube: KubeCluster, node: str) -> list[dict[str, Any]]:
    return [
        r
        for r in kube.items("devicetaintrules")
        if (r["spec"].get("deviceSelector") or {}).get("pool") == node
    ]


def tainted_devices(kube: KubeCluster, node: str) -> set[str]:
    """Devices of the node's slice some DeviceTaintRule selects (as the allocator matches)."""
    (slice_,) = kube.items("resourceslices", "--field-selector", f"spec.nodeName={node}")
    out = set()
    for dev in slice_["spec"]["devices"]:
        for r in kube.items("devicetaintrules"):
            sel = r["spec"].get("deviceSelector") or {}
            if (
                sel.get("driver", DRIVER) == DRIVER
                and sel.get("pool", node) == node
                and sel.get("device", dev["name"]) == dev["name"]
            ):
                out.add(dev["name"])
    return out


def test_a_one_gpu_straggler_leaves_seven_gpus_allocatable_and_the_node_schedulable(
    dra: KubeCluster,
) -> None:
    kube = dra
    node = gpu_node(kube)
    out = backend(kube).apply(command(node))
    assert out.changed and "GPU 2" in out.detail and "node schedulable" in out.detail, out.detail
    [rule] = rules_for(kube, node)
    assert rule["metadata"]["name"] == device_rule_name(node, Device(DRIVER, node, "gpu-2"))
    assert rule["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": node, "device": "gpu-2"}
    taint = rule["spec"]["taint"]
    assert (taint["key"], taint["value"], taint["effect"]) == (KEY, "straggler", "NoSchedule")
    got = kube.get("node", node)
    assert not got["spec"].get("unschedulable")  # not cordoned
    assert KEY not in {t["key"] for t in got["spec"].get("taints") or []}
    assert tainted_devices(kube, node) == {"gpu-2"}  # 7 of 8 untainted
    cond = next(c for c in got["status"]["conditions"] if c["type"] == "C4streamFaulty")
    assert cond["reason"] == "Straggler"  # the node still says why

    # Eight pods each claim one GPU of this node: the scheduler places seven, never on gpu-2.
    kube.need_controllers()
    ns = kube.namespace("dra")
    for i in range(8):
        kube.create(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"gpu-{i}", "namespace": ns},
                "spec": {
                    "devices": {
                        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]
                    }
                },
            }
        )
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"rank-{i}", "namespace": ns},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": f"gpu-{i}"}],
                    "containers": [
                        {
                            "name": "c",
                            "image": "example.com/train:1",
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                },
            }
        )

    def placed() -> list[dict[str, Any]] | None:
        pods = kube.items("pods", "-n", ns)
        bound = [p for p in pods if p["spec"].get("nodeName")]
        unschedulable = [
            p
            for p in pods
            if any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        ]
        return pods if len(bound) == 7 and len(unschedulable) == 1 else None

    pods = kube.wait("7 pods bound and 1 unschedulable", placed, timeout=120)
    allocated = []
    for claim in kube.items("resourceclaims", "-n", ns):
        for res in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get(
            "results"
        ) or []:
            allocated.append(res["device"])
    assert sorted(allocated) == [f"gpu-{i}" for i in range(8) if i != 2]
    assert {p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")} == {node}


def test_escalation_repeats_and_faults_that_are_not_one_gpu(dra: KubeCluster) -> None:
    kube = dra
    node = gpu_node(kube)
    be = backend(kube)
    be.apply(command(node))
    [rule] = rules_for(kube, node)
    generation = rule["metadata"]["generation"]  # (the eviction controller writes status)
    again = be.apply(command(node))
    assert "nothing changed" in again.detail and not again.changed
    assert rules_for(kube, node)[0]["metadata"]["generation"] == generation
    # cordon_and_taint (NoExecute by default) strengthens the same rule ...
    be.apply(command(node, action="cordon_and_taint", fault="noncomm_hang"))
    [rule] = rules_for(kube, node)
    assert (rule["spec"]["taint"]["effect"], rule["spec"]["taint"]["value"]) == (
        "NoExecute",
        "noncomm_hang",
    )
    # ... and a milder command later never weakens it.
    out = be.apply(command(node))
    [rule] = rules_for(kube, node)
    assert rule["spec"]["taint"]["effect"] == "NoExecute" and ":NoExecute" in out.detail
    assert not kube.get("node", node)["spec"].get("unschedulable")
    # A NIC fault is the host's: the node is cordoned as before.
    be.apply(command(node, fault="slow_nic", gpu=None, nic="mlx5_1"))
    assert kube.get("node", node)["spec"]["unschedulable"] is True
    assert len(rules_for(kube, node)) == 1


def test_a_gpu_the_slices_do_not_list_cordons_the_node(dra: KubeCluster) -> None:
    kube = dra
    node = gpu_node(kube, gpus=4)
    out = backend(kube).apply(command(node, gpu=6))
    assert "GPU 6 not in the node's ResourceSlices" in out.detail and "cordoned" in out.detail
    assert kube.get("node", node)["spec"]["unschedulable"] is True
    assert not rules_for(kube, node)
