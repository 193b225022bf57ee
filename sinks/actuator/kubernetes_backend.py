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
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

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
    "KubernetesBackend",
    "condition_reason",
    "event_name",
    "involved_node",
    "load_api_client",
    "upsert_taint",
]

log = logging.getLogger("c4stream.actuator.kubernetes")

_MERGE = "application/merge-patch+json"
_STRATEGIC = "application/strategic-merge-patch+json"


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

    def describe(self, cmd: IsolationCommand) -> str:
        cordon, effect = self._effects(cmd)
        steps = []
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
        spec_changed, current = self._write_spec(node, cordon, effect, cmd.fault)
        cond_changed = self._set_condition(node, cmd, current)
        try:
            self._post_event(node, cmd, current)
            event_note = ""
        except PermanentActionError as err:
            # The node is cordoned and marked: the action happened. A rejected Event is
            # worth a warning, not a failed (and dead-lettered) command.
            log.warning("node %s: Event not posted: %s", node, err)
            event_note = f"; Event not posted: {err}"
        what = []
        if cordon:
            what.append("cordoned")
        if effect:
            what.append(f"tainted {self.s.taint_key}={cmd.fault}:{effect}")
        what.append(f"condition {self.s.condition_type}=True")
        state = "" if spec_changed or cond_changed else " (already so; nothing changed)"
        return ActionOutcome(
            changed=spec_changed or cond_changed,
            detail=f"node {node}: " + ", ".join(what) + state + event_note,
        )

    #: (resource, subresource, verb, namespaced) the backend uses; = rbac-actuator.yaml.
    NEEDS = (
        ("nodes", "", "get", False),
        ("nodes", "", "patch", False),
        ("nodes", "status", "patch", False),
        ("events", "", "create", True),
    )

    def check(self) -> list[str]:
        """Ask the API server (SelfSubjectAccessReview) for each permission the backend needs."""
        if self._api_client is None:
            raise ActuatorConfigError("the Kubernetes backend has no API client")
        from kubernetes.client import AuthorizationV1Api

        authz = AuthorizationV1Api(self._api_client)
        lines, missing = [], []
        for resource, sub, verb, namespaced in self.NEEDS:
            attrs: dict[str, str] = {"resource": resource, "verb": verb, "group": ""}
            if sub:
                attrs["subresource"] = sub
            if namespaced:
                attrs["namespace"] = self.s.event_namespace
            body = {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": attrs},
            }
            what = f"{verb} {resource}{'/' + sub if sub else ''}" + (
                f" in namespace {self.s.event_namespace}" if namespaced else ""
            )
            try:
                resp = authz.create_self_subject_access_review(
                    body, _preload_content=False, _request_timeout=self.s.request_timeout_s
                )
            except Exception as err:
                raise self._classify("(check)", "review access for", err) from err
            allowed = bool((json.loads(resp.data).get("status") or {}).get("allowed"))
            lines.append(f"kubernetes: {what}: {'allowed' if allowed else 'DENIED'}")
            if not allowed:
                missing.append(what)
        if missing:
            raise ActuatorConfigError(
                "kubernetes: not allowed to " + ", ".join(missing) + ": apply "
                "compose/k8s/rbac-actuator.yaml to the actuator's service account"
            )
        return lines

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

    def _classify(self, node: str, verb: str, err: Exception) -> Exception:
        """Map a client error onto the actuator's error policy."""
        from kubernetes.client.exceptions import ApiException

        if not isinstance(err, ApiException):
            # Connection refused, timeouts, TLS: the API server may be back soon.
            return TransientActionError(f"{verb} node {node}: {type(err).__name__}: {err}")
        status = err.status or 0
        text = f"{verb} node {node}: HTTP {status} {err.reason}: {_api_message(err)}"
        if status in (401, 403):
            return ActuatorConfigError(
                f"{text}. Grant the actuator's service account the rules of "
                "compose/k8s/rbac-actuator.yaml (or fix the kubeconfig credentials)"
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


def _api_message(err: Exception) -> str:
    """The ``message`` of a Kubernetes Status body, else the raw body (shortened)."""
    body = getattr(err, "body", None) or ""
    try:
        return str(json.loads(body).get("message", body))[:300]
    except (ValueError, AttributeError):
        return str(body)[:300]
