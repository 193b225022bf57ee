"""The actuator's configuration: one typed object, built by the CLI and passed down.

>>> cfg = ActuatorConfig(backend="command",
...                      command=CommandSettings(template="scontrol update nodename={host}"))
>>> cfg.execute, cfg.isolations_topic(), cfg.deadletter_topic()
(False, 'c4.isolations', 'c4.deadletter')
>>> cfg.is_denied("login-1"), ActuatorConfig(deny=("login-*",)).is_denied("LOGIN-1")
(False, True)
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

import msgspec

from c4stream.kafka import KafkaConfig
from c4stream.topics import Topics

__all__ = [
    "DEFAULT_LEDGER",
    "ActuatorConfig",
    "CommandSettings",
    "KubernetesSettings",
]

#: Relative to the working directory of ``c4stream actuate``.
DEFAULT_LEDGER = ".c4stream/actuator-ledger.sqlite3"

TaintEffect = Literal["NoSchedule", "NoExecute"]


class KubernetesSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How the Kubernetes backend reaches the cluster and marks a node."""

    kubeconfig: str | None = None
    """Path of a kubeconfig file; None: $KUBECONFIG or ~/.kube/config."""
    context: str | None = None
    in_cluster: bool = False
    """Use the pod's service account (deploy with compose/k8s/rbac-actuator.yaml)."""
    taint_key: str = "c4stream.io/fault"
    """c4stream's own taint key; taints under other keys are never touched."""
    cordon_and_taint_effect: TaintEffect = "NoExecute"
    """Effect of the taint for ``cordon_and_taint`` (``cordon`` always uses NoSchedule).
    NoExecute evicts the pods that do not tolerate it, so the job restarts elsewhere."""
    condition_type: str = "C4streamFaulty"
    event_namespace: str = "default"
    """Node Events live in a namespace; kubectl describe node shows those of "default"."""
    component: str = "c4stream-actuator"
    """Event source / reporting component and the field manager of our writes."""
    conflict_retries: int = 5
    """Read-modify-write attempts when the node changed under us (409 Conflict)."""
    request_timeout_s: float = 10.0


class CommandSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The command backend: argv templates run without a shell."""

    template: str | None = None
    """For ``cordon`` and ``cordon_and_taint``, e.g.
    ``scontrol update nodename={host} state=drain reason="{reason}"``."""
    restart_template: str | None = None
    """For ``restart_job``; None: restart_job commands are recorded, nothing runs."""
    timeout_s: float = 30.0


class ActuatorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything ``c4stream actuate`` needs; no other setting is read anywhere else."""

    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    group: str = "c4stream-actuator"
    backend: Literal["kubernetes", "command"] = "kubernetes"
    execute: bool = False
    """False (the default): log exactly what would be done, do nothing."""
    deny: tuple[str, ...] = ()
    """Hosts never acted on; shell-style patterns (``login-*``), case-insensitive."""
    max_actions_per_job_per_hour: int = 2
    """The actuator's own cap, whatever the worker's policy decided: beyond it commands
    of that job are recorded as ``capped`` and do nothing (a forged or runaway stream
    cannot drain a job's hosts)."""
    fault_window_s: float = 3600.0
    """A command for a fault (job, host, component, fault) that already acted within
    this long is a duplicate, whatever its id."""
    ledger_path: str = DEFAULT_LEDGER
    ledger_retention_days: float = 30.0
    """Ledger rows older than this are pruned; keep it above c4.isolations' retention."""
    attempts: int = 3
    """Tries of a failing action (transient errors) before it is dead-lettered."""
    retry_backoff_s: float = 1.0
    """First pause between tries; doubled each time, with jitter."""
    poll_timeout_s: float = 0.5
    exit_when_idle_s: float | None = None
    """Stop after this long without a message (batch runs and tests); None: run on."""
    max_messages: int | None = None
    isolations: str | None = None
    """Topic override; None: ``Topics(prefix=kafka.topic_prefix).isolations``."""
    deadletter: str | None = None
    kubernetes: KubernetesSettings = msgspec.field(default_factory=KubernetesSettings)
    command: CommandSettings = msgspec.field(default_factory=CommandSettings)

    def topics(self) -> Topics:
        return Topics(prefix=self.kafka.topic_prefix)

    def isolations_topic(self) -> str:
        return self.isolations or self.topics().isolations

    def deadletter_topic(self) -> str:
        return self.deadletter or self.topics().deadletter

    def is_denied(self, host: str) -> bool:
        """Whether ``host`` matches a deny pattern (host names are case-insensitive)."""
        h = host.lower()
        return any(fnmatchcase(h, p.lower()) for p in self.deny)
