"""The Kubernetes backend: cordon, taint, a Node condition and an Event, via the official client.

What each action does to the Node named like the command's host:

=====================  ===================================================
action                 effect
=====================  ===================================================
``cordon``             ``spec.unschedulable = true`` and the taint
                       ``c4stream.io/fault=<fault>:NoSchedule``
``cordon_and_taint``   the same, with the taint's effect from the config
                       (default ``NoExecute``: pods that do not tolerate it
                       are evicted, so the job restarts without the node)
``restart_job``        condition and Event only; the node stays schedulable
``alert_only``         never reaches a backend
=====================  ===================================================

**One GPU, not the node** (``gpu_isolation = "device"``, Kubernetes >= 1.37): a fault of
one GPU (``device_faults``: a straggler, a hung GPU; the command names its index) taints
that device instead of the node: a DRA ``DeviceTaintRule`` (resource.k8s.io/v1) named
after node and device selects exactly that device (driver, pool and name, found in the
node's ResourceSlices by the ``index`` attribute) and carries the taint
``c4stream.io/fault=<fault>`` with ``NoSchedule`` (``cordon``) or the configured effect
(``cordon_and_taint``; ``NoExecute`` makes the device-taint eviction controller evict
the pods using that GPU). The node stays schedulable and its other GPUs allocatable.
NIC, link and communication faults, and a node whose ResourceSlices do not list the
GPU, still cordon the node.

plus, for each of them, the status condition ``C4streamFaulty=True`` (reason: the
fault in CamelCase, e.g. ``SlowNic``; message: the command's reason) and a Warning
Event whose involvedObject is the Node.

**Why read-modify-write with the resourceVersion.** ``spec.taints`` has no patch
merge key, so a strategic-merge patch replaces the whole list: patching in our taint
would delete a taint another controller added a moment earlier. So the backend GETs
the node, edits the list (other owners' taints kept as they are, ours added or its
value updated), and writes it back as a JSON merge patch that carries
``metadata.resourceVersion``. The API server applies it only if the node is still at
that version; otherwise it answers 409 Conflict and we read again and redo the edit
(at most ``conflict_retries`` times). A merge patch rather than a PUT of the whole
object, because a client-side model drops fields it does not know and a PUT would
erase them.

The condition goes to ``nodes/status`` as a strategic-merge patch: conditions *do*
merge by ``type`` there, so the kubelet's conditions stay, and no resourceVersion is
sent because the kubelet updates status every few seconds and would make us lose
every race.

Repeats are safe: a node already cordoned with our taint at that value is not
written; the Event's name derives from the command id, so a repeat finds it exists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from sinks.actuator.backends import (
    ActionOutcome,
    ActuatorConfigError,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.config import KubernetesSettings
from sinks.actuator.recovery import Found, node_isolated
from streams.commands import IsolationCommand

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

__all__ = [
    "Device",
    "KubernetesBackend",
    "Permission",
    "api_message",
    "check_permissions",
    "condition_reason",
    "device_rule_name",
    "event_name",
    "find_device",
    "involved_node",
    "load_api_client",
    "raw_call",
    "upsert_taint",
]

log = logging.getLogger("c4stream.actuator.kubernetes")

_MERGE = "application/merge-patch+json"
_STRATEGIC = "application/strategic-merge-patch+json"
_DRA = "/apis/resource.k8s.io/v1"
_RBAC = "compose/k8s/rbac-actuator.yaml"
_RBAC_DRA = "compose/k8s/rbac-actuator-dra.yaml"
#: Weakest first: a repeat with a weaker effect never weakens a device's taint.
_DEVICE_EFFECTS = ("None", "NoSchedule", "NoExecute")


class Permission(NamedTuple):
    """One thing the actuator asks the API server to let it do, and where it is granted."""

    group: str
    resource: str
    subresource: str
    verb: str
    namespace: str | None
    manifest: str

    def text(self) -> str:
        res = self.resource + (f"/{self.subresource}" if self.subresource else "")
        if self.group:
            res += f".{self.group}"
        return f"{self.verb} {res}" + (f" in namespace {self.namespace}" if self.namespace else "")


class Device(NamedTuple):
    """A DRA device: what a DeviceTaintRule's selector names."""

    driver: str
    pool: str
    name: str


def raw_call(
    api_client: ApiClient,
    method: str,
    path: str,
    *,
    timeout: float,
    body: Any = None,
    query: dict[str, str] | None = None,
    content_type: str | None = None,
) -> dict[str, Any]:
    """One request as raw JSON (no model: a client older than the server lacks the newer
    kinds, and models drop fields they do not know). Errors raise ``ApiException``."""
    from kubernetes.client.exceptions import ApiException

    headers = {"Accept": "application/json"}
    if content_type or body is not None:
        headers["Content-Type"] = content_type or "application/json"
    params = list((query or {}).items())
    if hasattr(api_client, "param_serialize"):  # the newer generated client (v34+ style)
        req = api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=params,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = api_client.call_api(*req, _request_timeout=timeout)
        resp.read()
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
    else:  # older clients: call_api raises on non-2xx itself
        resp = api_client.call_api(
            path,
            method,
            query_params=params,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
            _preload_content=False,
            _request_timeout=timeout,
        )
    return dict(json.loads(resp.data)) if resp.data else {}


def check_permissions(
    api_client: ApiClient,
    needs: Iterable[Permission],
    *,
    timeout: float,
    prefix: str,
    classify: Callable[[Exception], Exception],
) -> list[str]:
    """A SelfSubjectAccessReview per permission; one line each. Raises
    ``ActuatorConfigError`` naming every one denied and the manifest that grants it."""
    lines, missing = [], []
    for p in needs:
        attrs: dict[str, str] = {"group": p.group, "resource": p.resource, "verb": p.verb}
        if p.subresource:
            attrs["subresource"] = p.subresource
        if p.namespace:
            attrs["namespace"] = p.namespace
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attrs},
        }
        try:
            resp = raw_call(
                api_client,
                "POST",
                "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
                body=body,
                timeout=timeout,
            )
        except Exception as err:
            raise classify(err) from err
        allowed = bool((resp.get("status") or {}).get("allowed"))
        lines.append(f"{prefix}: {p.text()}: {'allowed' if allowed else 'DENIED'}")
        if not allowed:
            missing.append(p)
    if missing:
        manifests = sorted({p.manifest for p in missing})
        raise ActuatorConfigError(
            f"{prefix}: not allowed to "
            + ", ".join(p.text() for p in missing)
            + ": apply "
            + " and ".join(manifests)
            + " to the actuator's service account"
        )
    return lines


def find_device(
    slices: Iterable[dict[str, Any]], gpu: int, *, driver: str, attribute: str
) -> Device | None:
    """The device of ``driver`` whose ``attribute`` is ``gpu``, from a node's ResourceSlices.

    Only the newest generation of each pool counts (a driver republishing its slices
    leaves older ones until it deletes them). The attribute may be published qualified
    (``gpu.nvidia.com/index``) or not; its value is ``{"int": n}``.

    >>> s = {"spec": {"driver": "gpu.nvidia.com", "pool": {"name": "n1", "generation": 2},
    ...      "devices": [{"name": f"gpu-{i}", "attributes": {"index": {"int": i}}}
    ...                  for i in range(8)]}}
    >>> old = {"spec": {**s["spec"], "pool": {"name": "n1", "generation": 1},
    ...        "devices": [{"name": "stale", "attributes": {"index": {"int": 3}}}]}}
    >>> find_device([old, s], 3, driver="gpu.nvidia.com", attribute="index")
    Device(driver='gpu.nvidia.com', pool='n1', name='gpu-3')
    >>> find_device([s], 9, driver="gpu.nvidia.com", attribute="index") is None
    True
    """
    slices = [x for x in slices if (x.get("spec") or {}).get("driver") == driver]
    newest: dict[str, int] = {}
    for x in slices:
        pool = x["spec"].get("pool") or {}
        name, gen = pool.get("name", ""), int(pool.get("generation") or 0)
        newest[name] = max(newest.get(name, gen), gen)
    names = (attribute, f"{driver}/{attribute}")
    for x in slices:
        pool = x["spec"].get("pool") or {}
        if int(pool.get("generation") or 0) != newest[pool.get("name", "")]:
            continue
        for dev in x["spec"].get("devices") or []:
            attrs = dev.get("attributes") or {}
            for n in names:
                if n in attrs and (attrs[n] or {}).get("int") == gpu:
                    return Device(driver, pool.get("name", ""), dev["name"])
    return None


def device_rule_name(node: str, device: Device) -> str:
    """The DeviceTaintRule's name: readable, stable per device, a valid object name.

    >>> device_rule_name("gpu-node-3", Device("gpu.nvidia.com", "gpu-node-3", "gpu-2"))
    'c4stream.gpu-node-3.gpu-2.47edf380'
    """
    digest = hashlib.sha256("/".join(device).encode()).hexdigest()[:8]
    return f"c4stream.{node[:180]}.{device.name[:60]}.{digest}".lower()


def condition_reason(fault: str) -> str:
    """Kubernetes reasons are CamelCase words.

    >>> condition_reason("noncomm_hang"), condition_reason("slow_nic")
    ('NoncommHang', 'SlowNic')
    """
    return "".join(part.capitalize() for part in fault.split("_"))


def event_name(node: str, cmd_id: str) -> str:
    """A stable Event name per (node, command), so a repeat does not post twice.

    >>> event_name("gpu-node-3", "c4-17")
    'gpu-node-3.c4stream.03557b2283e5e184'
    """
    digest = hashlib.sha256(cmd_id.encode()).hexdigest()[:16]
    return f"{node[:200]}.c4stream.{digest}"


def upsert_taint(
    taints: list[dict[str, Any]], key: str, value: str, effect: str
) -> tuple[list[dict[str, Any]], bool]:
    """Our taint with ``effect`` added; every taint of ours set to ``value``; others kept.

    Returns the new list and whether it differs. A node holds at most one taint per
    (key, effect). All taints under our key carry the latest fault, so an escalation
    from ``cordon`` (NoSchedule) to ``cordon_and_taint`` (NoExecute) does not leave two
    different faults on one node.

    >>> other = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    >>> new, changed = upsert_taint([other], "c4stream.io/fault", "straggler", "NoSchedule")
    >>> changed, new[0] == other, new[1]
    (True, True, {'key': 'c4stream.io/fault', 'value': 'straggler', 'effect': 'NoSchedule'})
    >>> upsert_taint(new, "c4stream.io/fault", "straggler", "NoSchedule")[1]
    False
    >>> [t["value"] for t in upsert_taint(new, "c4stream.io/fault", "slow_nic", "NoExecute")[0]]
    ['present', 'slow_nic', 'slow_nic']
    """
    out: list[dict[str, Any]] = []
    found = changed = False
    for t in taints:
        if t.get("key") == key:
            found = found or t.get("effect") == effect
            if t.get("value") != value:
                t = {"key": key, "value": value, "effect": t.get("effect")}
                changed = True
        out.append(t)
    if not found:
        out.append({"key": key, "value": value, "effect": effect})
        changed = True
    return out, changed


def involved_node(node: str, uid: str, namespace: str) -> dict[str, str]:
    """The Event's ``involvedObject`` for a Node, valid in the Event's ``namespace``.

    The API server's rule (``ValidateEvent`` for core/v1 Events without ``eventTime``):
    an involvedObject without a namespace (a cluster-scoped Node) is allowed only in an
    Event of namespace ``default``; otherwise ``involvedObject.namespace`` must equal the
    Event's namespace, or the create fails with 422 "does not match event.namespace".
    ``kubectl describe node`` lists only the Events in ``default``; Events elsewhere are
    seen with ``kubectl get events -n NAMESPACE``.

    >>> involved_node("n1", "u1", "default")
    {'apiVersion': 'v1', 'kind': 'Node', 'name': 'n1', 'uid': 'u1'}
    >>> involved_node("n1", "u1", "c4stream")["namespace"]
    'c4stream'
    """
    out = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}
    if namespace not in ("", "default"):
        out["namespace"] = namespace
    return out


def load_api_client(settings: KubernetesSettings) -> ApiClient:
    """An ApiClient from the pod's service account or a kubeconfig file."""
    from kubernetes import client, config

    conf = client.Configuration()
    try:
        if settings.in_cluster:
            config.load_incluster_config(client_configuration=conf)
        else:
            config.load_kube_config(
                config_file=settings.kubeconfig,
                context=settings.context,
                client_configuration=conf,
            )
    except (config.ConfigException, OSError, TypeError, ValueError) as err:
        where = (
            "the in-cluster service account"
            if settings.in_cluster
            else (f"kubeconfig {settings.kubeconfig or '$KUBECONFIG or ~/.kube/config'}")
        )
        raise ActuatorConfigError(f"cannot load {where}: {err}") from err
    return client.ApiClient(conf)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubernetesBackend:
    """Cordon + taint + condition + Event (see the module docstring)."""

    name = "kubernetes"

    def __init__(self, settings: KubernetesSettings, api_client: ApiClient | None) -> None:
        """``api_client`` None: describe only (dry-run needs no cluster)."""
        self.s = settings
        self._api_client = api_client
        self._core: Any = None
        if api_client is not None:
            from kubernetes.client import CoreV1Api

            self._core = CoreV1Api(api_client)

    # ---------------------------------------------------------------- describe

    def _effects(self, cmd: IsolationCommand) -> tuple[bool, str | None]:
        """(cordon?, taint effect or None) for the command's action."""
        if cmd.action == "cordon":
            return True, "NoSchedule"
        if cmd.action == "cordon_and_taint":
            return True, self.s.cordon_and_taint_effect
        return False, None  # restart_job: condition + Event only

    def _device_fault(self, cmd: IsolationCommand) -> bool:
        """Whether this command isolates one GPU rather than its node."""
        return (
            self.s.gpu_isolation == "device"
            and cmd.gpu is not None
            and cmd.fault in self.s.device_faults
            and cmd.action in ("cordon", "cordon_and_taint")
        )

    def describe(self, cmd: IsolationCommand) -> str:
        cordon, effect = self._effects(cmd)
        steps = []
        if self._device_fault(cmd):
            steps.append(
                f"taint GPU {cmd.gpu} (driver {self.s.dra_driver}, attribute "
                f"{self.s.device_index_attribute}) with DeviceTaintRule "
                f"{self.s.taint_key}={cmd.fault}:{effect}, the node staying schedulable "
                "(cordoned instead if its ResourceSlices do not list that GPU)"
            )
        else:
            if cordon:
                steps.append("set spec.unschedulable=true")
            if effect:
                steps.append(
                    f"add or update taint {self.s.taint_key}={cmd.fault}:{effect} "
                    "(other taints kept; write guarded by resourceVersion)"
                )
        steps.append(
            f"set status condition {self.s.condition_type}=True "
            f"reason={condition_reason(cmd.fault)} message={cmd.reason!r}"
        )
        steps.append(
            f"create Warning Event {event_name(cmd.host, cmd.id)} in namespace "
            f"{self.s.event_namespace}"
        )
        return f"kubernetes: node {cmd.host}: " + "; ".join(steps)

    # ---------------------------------------------------------------- apply

    def apply(self, cmd: IsolationCommand) -> ActionOutcome:
        if self._core is None:
            raise ActuatorConfigError("the Kubernetes backend has no API client (dry-run only)")
        node = cmd.host
        cordon, effect = self._effects(cmd)
        what = []
        device = None
        if self._device_fault(cmd):
            assert cmd.gpu is not None and effect is not None  # _device_fault says so
            device = self._find_device(node, cmd.gpu)
            if device is None:
                what.append(
                    f"GPU {cmd.gpu} not in the node's ResourceSlices (driver "
                    f"{self.s.dra_driver}): the node is cordoned instead"
                )
        if device is not None:
            assert effect is not None and cmd.gpu is not None
            current = self._read(node)  # first: no rule for a node that does not exist
            rule, spec_changed, effect = self._taint_device(node, device, effect, cmd.fault)
            what.append(
                f"GPU {cmd.gpu} ({device.driver}/{device.pool}/{device.name}) tainted "
                f"{self.s.taint_key}={cmd.fault}:{effect} by DeviceTaintRule {rule}, "
                "node schedulable"
            )
        else:
            spec_changed, current = self._write_spec(node, cordon, effect, cmd.fault)
            if cordon:
                what.append("cordoned")
            if effect:
                what.append(f"tainted {self.s.taint_key}={cmd.fault}:{effect}")
        cond_changed = self._set_condition(node, cmd, current)
        try:
            self._post_event(node, cmd, current)
            event_note = ""
        except PermanentActionError as err:
            # The node is cordoned and marked: the action happened. A rejected Event is
            # worth a warning, not a failed (and dead-lettered) command.
            log.warning("node %s: Event not posted: %s", node, err)
            event_note = f"; Event not posted: {err}"
        what.append(f"condition {self.s.condition_type}=True")
        state = "" if spec_changed or cond_changed else " (already so; nothing changed)"
        return ActionOutcome(
            changed=spec_changed or cond_changed,
            detail=f"node {node}: " + ", ".join(what) + state + event_note,
        )

    def needs(self) -> list[Permission]:
        """What the backend calls with these settings (= rbac-actuator[-dra].yaml)."""
        ns = self.s.event_namespace
        out = [
            Permission("", "nodes", "", "get", None, _RBAC),
            Permission("", "nodes", "", "patch", None, _RBAC),
            Permission("", "nodes", "status", "patch", None, _RBAC),
            Permission("", "events", "", "create", ns, _RBAC),
        ]
        if self.s.gpu_isolation == "device":
            g = "resource.k8s.io"
            out += [
                Permission(g, "resourceslices", "", "list", None, _RBAC_DRA),
                Permission(g, "devicetaintrules", "", "get", None, _RBAC_DRA),
                Permission(g, "devicetaintrules", "", "create", None, _RBAC_DRA),
                Permission(g, "devicetaintrules", "", "patch", None, _RBAC_DRA),
            ]
        return out

    def dra_served(self) -> bool:
        """Whether the API server serves DeviceTaintRules in resource.k8s.io/v1."""
        from kubernetes.client.exceptions import ApiException

        assert self._api_client is not None
        try:
            found = raw_call(self._api_client, "GET", _DRA, timeout=self.s.request_timeout_s)
        except ApiException as err:
            if err.status == 404:
                return False
            raise self._classify("(check)", "discover resource.k8s.io/v1 on", err) from err
        except Exception as err:
            raise self._classify("(check)", "discover resource.k8s.io/v1 on", err) from err
        return any(r.get("name") == "devicetaintrules" for r in found.get("resources") or [])

    def check(self) -> list[str]:
        """Ask the API server (SelfSubjectAccessReview) for each permission the backend
        needs, and whether it serves DRA device taints (``gpu_isolation``)."""
        if self._api_client is None:
            raise ActuatorConfigError("the Kubernetes backend has no API client")
        lines = check_permissions(
            self._api_client,
            self.needs(),
            timeout=self.s.request_timeout_s,
            prefix="kubernetes",
            classify=lambda err: self._classify("(check)", "review access for", err),
        )
        served = self.dra_served()
        if self.s.gpu_isolation == "device":
            if not served:
                raise ActuatorConfigError(
                    'kubernetes: gpu_isolation = "device" but this API server does not '
                    "serve resource.k8s.io/v1 devicetaintrules (Kubernetes >= 1.37, feature "
                    "gates DRADeviceTaints and DRADeviceTaintRules): set gpu_isolation = "
                    '"node" to cordon the node for a GPU fault'
                )
            lines.append(
                "kubernetes: DRA device taints served (resource.k8s.io/v1 devicetaintrules): "
                f"faults {', '.join(self.s.device_faults)} of one GPU taint that GPU"
            )
        elif served:
            lines.append(
                "kubernetes: DRA device taints served (resource.k8s.io/v1 devicetaintrules), "
                'but gpu_isolation = "node": a GPU fault cordons its node; set "device" '
                f"(and apply {_RBAC_DRA}) to take only the GPU out of service"
            )
        else:
            lines.append(
                "kubernetes: DRA device taints not served by this API server: a GPU fault "
                'cordons its node (gpu_isolation = "node")'
            )
        return lines

    def _find_device(self, node: str, gpu: int) -> Device | None:
        try:
            found = raw_call(
                self._api_client,  # type: ignore[arg-type]
                "GET",
                f"{_DRA}/resourceslices",
                query={"fieldSelector": f"spec.nodeName={node},spec.driver={self.s.dra_driver}"},
                timeout=self.s.request_timeout_s,
            )
        except Exception as err:
            if getattr(err, "status", None) == 404:  # the API itself, not a node, is missing
                raise ActuatorConfigError(
                    'gpu_isolation = "device" but the API server serves no '
                    "resource.k8s.io/v1 resourceslices (Kubernetes >= 1.37): set "
                    'gpu_isolation = "node"'
                ) from err
            raise self._classify(node, "list ResourceSlices of", err, _RBAC_DRA) from err
        return find_device(
            found.get("items") or [],
            gpu,
            driver=self.s.dra_driver,
            attribute=self.s.device_index_attribute,
        )

    def _taint_device(
        self, node: str, device: Device, effect: str, fault: str
    ) -> tuple[str, bool, str]:
        """Create or update our DeviceTaintRule for ``device``; (name, changed, effect).

        A rule already there with a stronger effect keeps it (a NoExecute taint is never
        weakened to NoSchedule by a later, milder command); its value becomes ``fault``.
        Updates carry the resourceVersion read: 409 means re-read and redo.
        """
        from kubernetes.client.exceptions import ApiException

        name = device_rule_name(node, device)
        path = f"{_DRA}/devicetaintrules/{name}"
        api: Any = self._api_client
        t = self.s.request_timeout_s
        for _ in range(self.s.conflict_retries):
            try:
                rule = raw_call(api, "GET", path, timeout=t)
            except ApiException as err:
                if err.status != 404:
                    raise self._classify(node, "read DeviceTaintRule for", err, _RBAC_DRA) from err
                rule = None
            except Exception as err:
                raise self._classify(node, "read DeviceTaintRule for", err, _RBAC_DRA) from err
            if rule is None:
                body = {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceTaintRule",
                    "metadata": {
                        "name": name,
                        "labels": {"app.kubernetes.io/managed-by": self.s.component},
                    },
                    "spec": {
                        "deviceSelector": {
                            "driver": device.driver,
                            "pool": device.pool,
                            "device": device.name,
                        },
                        "taint": {"key": self.s.taint_key, "value": fault, "effect": effect},
                    },
                }
                what = "create DeviceTaintRule for"
                try:
                    raw_call(api, "POST", f"{_DRA}/devicetaintrules", body=body, timeout=t)
                    return name, True, effect
                except ApiException as err:
                    if err.status == 409:  # created meanwhile: read it and compare
                        continue
                    raise self._classify(node, what, err, _RBAC_DRA) from err
                except Exception as err:
                    raise self._classify(node, what, err, _RBAC_DRA) from err
            old = (rule.get("spec") or {}).get("taint") or {}
            old_effect = old.get("effect", "None")
            if old_effect in _DEVICE_EFFECTS and _DEVICE_EFFECTS.index(
                old_effect
            ) > _DEVICE_EFFECTS.index(effect):
                effect = old_effect
            if (old.get("key"), old.get("value"), old_effect) == (self.s.taint_key, fault, effect):
                return name, False, effect
            patch = {
                "metadata": {"resourceVersion": rule["metadata"]["resourceVersion"]},
                "spec": {"taint": {"key": self.s.taint_key, "value": fault, "effect": effect}},
            }
            try:
                raw_call(api, "PATCH", path, body=patch, content_type=_MERGE, timeout=t)
                return name, True, effect
            except ApiException as err:
                if err.status != 409:
                    raise self._classify(node, "patch DeviceTaintRule for", err, _RBAC_DRA) from err
            except Exception as err:
                raise self._classify(node, "patch DeviceTaintRule for", err, _RBAC_DRA) from err
        raise TransientActionError(
            f"node {node}: DeviceTaintRule {name}: {self.s.conflict_retries} writes lost to "
            "concurrent changes (409 Conflict each time); will retry"
        )

    def _read(self, node: str) -> dict[str, Any]:
        """The node as raw JSON: the client's models would drop fields they do not know."""
        resp = self._call(node, "read", self._core.read_node, node, _preload_content=False)
        return json.loads(resp.data)

    def _write_spec(
        self, node: str, cordon: bool, effect: str | None, fault: str
    ) -> tuple[bool, dict[str, Any]]:
        """Read-modify-write of spec, retried on 409. Returns (changed, node as last read)."""
        for attempt in range(1, self.s.conflict_retries + 1):
            current = self._read(node)
            spec = current.get("spec") or {}
            taints = list(spec.get("taints") or [])
            changed = False
            if effect:
                taints, changed = upsert_taint(taints, self.s.taint_key, fault, effect)
            patch_spec: dict[str, Any] = {}
            if changed:
                patch_spec["taints"] = taints  # the whole list: merge patch replaces lists
            if cordon and not spec.get("unschedulable"):
                patch_spec["unschedulable"] = True
            if not patch_spec:
                return False, current
            rv = current["metadata"]["resourceVersion"]
            patch = {"metadata": {"resourceVersion": rv}, "spec": patch_spec}
            from kubernetes.client.exceptions import ApiException

            try:
                self._core.patch_node(
                    node,
                    patch,
                    field_manager=self.s.component,
                    _content_type=_MERGE,
                    _preload_content=False,  # we need no model of the answer
                    _request_timeout=self.s.request_timeout_s,
                )
                return True, current
            except ApiException as err:
                if err.status != 409:
                    raise self._classify(node, "patch", err) from err
                log.info(
                    "node %s changed since resourceVersion %s (409 Conflict); "
                    "re-reading (attempt %d/%d)",
                    node,
                    rv,
                    attempt,
                    self.s.conflict_retries,
                )
                time.sleep(random.uniform(0.0, 0.05 * attempt))  # de-synchronize racers
            except Exception as err:
                raise self._classify(node, "patch", err) from err
        raise TransientActionError(
            f"node {node}: {self.s.conflict_retries} writes lost to concurrent changes "
            "(409 Conflict each time); will retry"
        )

    def _set_condition(self, node: str, cmd: IsolationCommand, current: dict[str, Any]) -> bool:
        reason = condition_reason(cmd.fault)
        old = next(
            (
                c
                for c in (current.get("status") or {}).get("conditions") or []
                if c.get("type") == self.s.condition_type
            ),
            None,
        )
        if (
            old
            and old.get("status") == "True"
            and old.get("reason") == reason
            and (old.get("message") == cmd.reason)
        ):
            return False
        now = _now()
        # lastTransitionTime moves only when the status flips (API conventions).
        transition = old["lastTransitionTime"] if old and old.get("status") == "True" else now
        cond = {
            "type": self.s.condition_type,
            "status": "True",
            "reason": reason,
            "message": cmd.reason,
            "lastHeartbeatTime": now,
            "lastTransitionTime": transition,
        }
        self._call(
            node,
            "patch status of",
            self._core.patch_node_status,
            node,
            {"status": {"conditions": [cond]}},
            field_manager=self.s.component,
            _content_type=_STRATEGIC,
            _preload_content=False,
        )
        return True

    def _post_event(self, node: str, cmd: IsolationCommand, current: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        now = _now()
        extra = "".join(
            f", {k} {v}"
            for k, v in (("gpu", cmd.gpu), ("nic", cmd.nic), ("peer host", cmd.peer_host))
            if v is not None
        )
        message = (
            f"{cmd.reason} (c4stream {cmd.action}: fault {cmd.fault}{extra}, job {cmd.job}, "
            f"confidence {cmd.confidence:.2f}, command {cmd.id})"
        )
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": event_name(node, cmd.id), "namespace": self.s.event_namespace},
            "involvedObject": involved_node(
                node, (current.get("metadata") or {}).get("uid", node), self.s.event_namespace
            ),
            "reason": condition_reason(cmd.fault),
            "message": message[:1024],
            "type": "Warning",
            "source": {"component": self.s.component, "host": node},
            "reportingComponent": self.s.component,
            "reportingInstance": self.s.component,
            "action": cmd.action,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._core.create_namespaced_event(
                self.s.event_namespace,
                body,
                _preload_content=False,
                _request_timeout=self.s.request_timeout_s,
            )
        except ApiException as err:
            if err.status == 409:  # a repeat: this command's Event is already there
                return
            raise self._classify(node, "create Event for", err) from err
        except Exception as err:
            raise self._classify(node, "create Event for", err) from err

    def _call(self, node: str, verb: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", self.s.request_timeout_s)
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            raise self._classify(node, verb, err) from err

    def _classify(self, node: str, verb: str, err: Exception, rbac: str = _RBAC) -> Exception:
        """Map a client error onto the actuator's error policy."""
        from kubernetes.client.exceptions import ApiException

        if not isinstance(err, ApiException):
            # Connection refused, timeouts, TLS: the API server may be back soon.
            return TransientActionError(f"{verb} node {node}: {type(err).__name__}: {err}")
        status = err.status or 0
        text = f"{verb} node {node}: HTTP {status} {err.reason}: {api_message(err)}"
        if status == 403 and "ValidatingAdmissionPolicy" in text:
            return ActuatorConfigError(
                f"{text}. The admission policy (compose/k8s/admission-actuator.yaml) refused "
                "it: its variables taintKey and conditionType must match [actuator.kubernetes]"
            )
        if status in (401, 403):
            return ActuatorConfigError(
                f"{text}. Grant the actuator's service account the rules of "
                f"{rbac} (or fix the kubeconfig credentials)"
            )
        if status == 404:
            return PermanentActionError(
                f"{text}. No such node: the command's host must be the Node's name"
            )
        if status in (400, 422):
            return PermanentActionError(f"{text}. The API server rejected the change")
        return TransientActionError(text)  # 409 on status/event, 429, 5xx

    def already_applied(self, cmd: IsolationCommand) -> Found:
        """After a crash while acting (sinks.actuator.recovery): is the node already
        cordoned and tainted as ``cmd`` asks? One GET, no write."""
        if self._core is None:
            return Found("unknown", "the Kubernetes backend has no API client")
        cordon, effect = self._effects(cmd)
        node = self._read(cmd.host)
        if cordon and node_isolated(
            node, taint_key=self.s.taint_key, fault=cmd.fault, cordon=cordon, effect=effect
        ):
            return Found("applied", f"node {cmd.host} is cordoned with {self.s.taint_key}")
        return Found("not_applied", f"node {cmd.host} is not yet cordoned and tainted")


def api_message(err: Exception) -> str:
    """The ``message`` of a Kubernetes Status body, else the raw body (shortened)."""
    body = getattr(err, "body", None) or ""
    try:
        return str(json.loads(body).get("message", body))[:300]
    except (ValueError, AttributeError):
        return str(body)[:300]
