"""Restart on Kubernetes: evict the job's pods on the isolated node.

The job's controller (a batch Job, a Kubeflow PyTorchJob, a JobSet, a LeaderWorkerSet)
replaces evicted pods; the node is cordoned (or the GPU tainted), so the replacements land
on healthy nodes or GPUs and the training resumes from its last checkpoint. Which pods
belong to the job: ``pod_selector`` with ``{job}`` replaced by the telemetry's job name
(default ``job-name={job}``, the label a batch Job puts on its pods). For a PyTorchJob use
``training.kubeflow.org/job-name={job}``; for a JobSet ``jobset.sigs.k8s.io/jobset-name={job}``;
for a LeaderWorkerSet ``leaderworkerset.sigs.k8s.io/name={job}``. The job name must be a
valid label value, so it cannot add terms to the selector.

**Why evict, not delete** (``method = "evict"``, the default). A deleted pod of a batch Job
counts as a failure against the Job's ``backoffLimit`` (6 by default): a few isolations
could fail the job they meant to save. An eviction (``policy/v1`` Eviction, the API
``kubectl drain`` uses) respects the job's PodDisruptionBudget (429 while it would be
violated: retried later) and gives the pod the condition ``DisruptionTarget``
(reason ``EvictionByEvictionAPI``), which a Job's ``podFailurePolicy`` rule
``{action: Ignore, onPodConditions: [{type: DisruptionTarget}]}`` leaves out of the count
(compose/k8s/example-training-job.yaml, docs/actuator.md). Group-restart controllers
(JobSet, PyTorchJob, LeaderWorkerSet) restart the whole group when one pod is lost; the
eviction's condition lets their failure policies tell a disruption from a crash too.

Requests (``compose/k8s/rbac-actuator-restart.yaml`` grants exactly these):

- ``GET /api/v1/namespaces/{ns}/pods?labelSelector=…&fieldSelector=spec.nodeName=…`` —
  the job's pods on the node (the plan);
- ``GET /api/v1/namespaces/{ns}/pods?labelSelector=…`` — all the job's pods: a restart
  is already in progress when one is ``Pending`` or being deleted (e.g. evicted by the
  ``NoExecute`` taint of ``cordon_and_taint``, which restarts the job by itself);
- ``GET /api/v1/namespaces/{ns}/pods?fieldSelector=metadata.name=…`` — the pod is still
  the one listed (same uid) just before its eviction: the Eviction API would retry a
  failed uid precondition for 10 s before answering 409;
- ``POST /api/v1/namespaces/{ns}/pods/{name}/eviction`` with ``deleteOptions.preconditions.uid``
  (``method = "delete"``: ``DELETE …/pods/{name}`` with the same precondition): only the
  pod that was listed goes, never a replacement that took its name. 404 (gone already)
  and 409 (a replacement) count as done: a safe repeat.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from sinks.actuator.backends import (
    ActionOutcome,
    ActuatorConfigError,
    PermanentActionError,
    TransientActionError,
)
from sinks.actuator.config import KubernetesSettings, RestartSettings
from sinks.actuator.kubernetes_backend import Permission, api_message, check_permissions
from sinks.actuator.restart import RestartPlan
from streams.commands import IsolationCommand

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

__all__ = ["KubernetesRestarter", "pod_selector"]

# https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
_RBAC = "compose/k8s/rbac-actuator-restart.yaml"


def pod_selector(template: str, job: str) -> str:
    """The label selector of ``job``'s pods; the job name must be a label value.

    >>> pod_selector("job-name={job}", "llm-70b")
    'job-name=llm-70b'
    >>> pod_selector("job-name={job}", "x,app!=y")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    sinks.actuator.backends.PermanentActionError: job name 'x,app!=y' is not a Kubernetes label ...
    """
    if not job or not _LABEL_VALUE.fullmatch(job):
        raise PermanentActionError(
            f"job name {job!r} is not a Kubernetes label value; no pods selected"
        )
    return template.replace("{job}", job)


class KubernetesRestarter:
    """Evicts (or deletes) the job's pods on the isolated node (see the module docstring)."""

    name = "kubernetes"

    def __init__(
        self,
        settings: RestartSettings,
        kube: KubernetesSettings,
        api_client: ApiClient | None,
    ) -> None:
        """``api_client`` None: describe only (dry run needs no cluster)."""
        if "{job}" not in settings.pod_selector:
            raise ActuatorConfigError(
                f"[actuator.restart] pod_selector {settings.pod_selector!r} must name {{job}}"
            )
        self.s = settings
        self.timeout_s = kube.request_timeout_s
        self._api_client = api_client
        self._core: Any = None
        if api_client is not None:
            from kubernetes.client import CoreV1Api  # optional heavy client: only when acting

            self._core = CoreV1Api(api_client)

    def _list(self, selector: str, node: str | None) -> list[dict[str, Any]]:
        kwargs: dict[str, Any] = {"label_selector": selector}
        if node is not None:
            kwargs["field_selector"] = f"spec.nodeName={node}"
        try:
            resp = self._core.list_namespaced_pod(
                self.s.namespace,
                _preload_content=False,  # raw JSON: no model round trip
                _request_timeout=self.timeout_s,
                **kwargs,
            )
        except Exception as err:
            raise self._classify(f"list pods {selector}", err) from err
        return list(json.loads(resp.data).get("items") or [])

    def plan(self, cmd: IsolationCommand, *, live: bool) -> RestartPlan:
        selector = pod_selector(self.s.pod_selector, cmd.job)
        where = f"namespace {self.s.namespace}, node {cmd.host}"
        if self._core is None:
            return RestartPlan(
                job=cmd.job,
                host=cmd.host,
                target=selector,
                description=f"kubernetes: {self._verb} the pods {selector} on node {cmd.host} "
                f"(namespace {self.s.namespace}) so that the job's controller replaces them",
            )
        pods = self._list(selector, cmd.host)
        live_pods = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
        if not pods:
            raise PermanentActionError(f"no pod {selector} on {where}")
        names = tuple((p["metadata"]["name"], p["metadata"].get("uid", "")) for p in live_pods)
        grace = "" if self.s.grace_period_s is None else f", grace {self.s.grace_period_s}s"
        return RestartPlan(
            job=cmd.job,
            host=cmd.host,
            target=",".join(n for n, _ in names) or selector,
            description=f"kubernetes: {self._verb} pod(s) {', '.join(n for n, _ in names) or '-'} "
            f"({selector}) on {where}{grace}",
            pods=names,
            extra={"selector": selector, "on_node": str(len(pods))},
        )

    def in_progress(self, plan: RestartPlan) -> str | None:
        if self._core is None:
            return None
        selector = plan.extra.get("selector") or pod_selector(self.s.pod_selector, plan.job)
        busy = []
        for p in self._list(selector, None):
            meta, status = p.get("metadata") or {}, p.get("status") or {}
            if meta.get("deletionTimestamp"):
                busy.append(f"{meta.get('name')} terminating")
            elif status.get("phase") == "Pending":
                busy.append(f"{meta.get('name')} pending")
        if not busy:
            return None
        return (
            f"a restart of job {plan.job} is already under way ({', '.join(sorted(busy)[:5])}"
            + (", …" if len(busy) > 5 else "")
            + "; a NoExecute taint evicts the pods by itself)"
        )

    def _same_pod(self, name: str, uid: str) -> bool:
        """Whether pod ``name`` is still the one listed (``uid``). Asked before an eviction
        because the Eviction API retries a failed uid precondition for 10 s before it
        answers 409; a list by name needs no permission beyond the plan's."""
        try:
            resp = self._core.list_namespaced_pod(
                self.s.namespace,
                field_selector=f"metadata.name={name}",
                _preload_content=False,
                _request_timeout=self.timeout_s,
            )
        except Exception as err:
            raise self._classify(f"list pod {name}", err) from err
        items = json.loads(resp.data).get("items") or []
        return any((p.get("metadata") or {}).get("uid") == uid for p in items)

    @property
    def _verb(self) -> str:
        return "evict" if self.s.method == "evict" else "delete"

    def needs(self) -> list[Permission]:
        """What the restarter calls (= rbac-actuator-restart.yaml)."""
        ns = self.s.namespace
        out = [Permission("", "pods", "", "list", ns, _RBAC)]
        if self.s.method == "evict":
            out.append(Permission("", "pods", "eviction", "create", ns, _RBAC))
        else:
            out.append(Permission("", "pods", "", "delete", ns, _RBAC))
        return out

    def check(self) -> list[str]:
        """SelfSubjectAccessReviews of :meth:`needs` (``actuate --check``)."""
        if self._api_client is None:
            raise ActuatorConfigError("the Kubernetes restarter has no API client")
        return check_permissions(
            self._api_client,
            self.needs(),
            timeout=self.timeout_s,
            prefix="kubernetes restart",
            classify=lambda err: self._classify("review access", err),
        )

    def restart(self, plan: RestartPlan) -> ActionOutcome:
        if self._core is None:
            raise ActuatorConfigError("the Kubernetes restarter has no API client (dry run only)")
        from kubernetes.client.exceptions import ApiException  # with the client, see above

        done, gone = [], []
        for name, uid in plan.pods:
            opts: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
            if uid:
                opts["preconditions"] = {"uid": uid}
            if self.s.grace_period_s is not None:
                opts["gracePeriodSeconds"] = self.s.grace_period_s
            if uid and self.s.method == "evict" and not self._same_pod(name, uid):
                gone.append(name)  # deleted, or replaced by a pod of the same name
                continue
            try:
                if self.s.method == "evict":
                    self._core.create_namespaced_pod_eviction(
                        name,
                        self.s.namespace,
                        {
                            "apiVersion": "policy/v1",
                            "kind": "Eviction",
                            "metadata": {"name": name, "namespace": self.s.namespace},
                            "deleteOptions": opts,
                        },
                        _preload_content=False,
                        # The API server retries an eviction that conflicts (a pod status
                        # update in between) for up to 10 s before it answers.
                        _request_timeout=max(self.timeout_s, 15.0),
                    )
                else:
                    self._core.delete_namespaced_pod(
                        name,
                        self.s.namespace,
                        body=opts,
                        _preload_content=False,
                        _request_timeout=self.timeout_s,
                    )
                done.append(name)
            except ApiException as err:
                if err.status in (404, 409):  # gone already, or a replacement took the name
                    gone.append(name)
                    continue
                if err.status == 429:
                    # A PodDisruptionBudget forbids it now; what was evicted stays evicted.
                    raise TransientActionError(
                        f"evict pod {name} in namespace {self.s.namespace}: HTTP 429: "
                        f"{api_message(err)} (the job's PodDisruptionBudget; retried"
                        + (f"; evicted already: {', '.join(done)})" if done else ")")
                    ) from err
                raise self._classify(f"{self._verb} pod {name}", err) from err
            except Exception as err:
                raise self._classify(f"{self._verb} pod {name}", err) from err
        past = "evicted" if self.s.method == "evict" else "deleted"
        detail = f"{past} pod(s) {', '.join(done) or '-'} of job {plan.job} on {plan.host}"
        if gone:
            detail += f" ({', '.join(gone)} already gone or replaced)"
        return ActionOutcome(changed=bool(done), detail=detail)

    def _classify(self, what: str, err: Exception) -> Exception:
        from kubernetes.client.exceptions import ApiException  # with the client, see above

        if not isinstance(err, ApiException):
            return TransientActionError(f"{what}: {type(err).__name__}: {err}")
        status = err.status or 0
        text = (
            f"{what} in namespace {self.s.namespace}: HTTP {status} {err.reason}: "
            f"{api_message(err)}"
        )
        if status in (401, 403):
            return ActuatorConfigError(
                f"{text}. Grant the actuator's service account the rules of {_RBAC}"
            )
        if status in (400, 404, 422):
            return PermanentActionError(text)
        return TransientActionError(text)
