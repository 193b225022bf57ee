"""The actuator's configuration: one typed object, built by the CLI and passed down.

>>> cfg = ActuatorConfig(backend="command",
...                      command=CommandSettings(template="scontrol update nodename={host}"))
>>> cfg.execute, cfg.isolations_topic(), cfg.deadletter_topic()
(False, 'c4.isolations', 'c4.deadletter')
>>> cfg.is_denied("login-1"), ActuatorConfig(deny=("login-*",)).is_denied("LOGIN-1")
(False, True)
>>> ActuatorConfig(strip_domain=True).node_name("node-005.cluster.local")
'node-005'
>>> ActuatorConfig(node_regex="^(?P<node>gpu-[0-9]+)-ib").node_name("gpu-17-ib.dc1")
'gpu-17'
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Literal

import msgspec

from c4base.config import Section
from c4base.kafka import KafkaConfig
from c4base.signing import load_keys
from c4base.topics import Topics
from streams.commands import Fault

__all__ = [
    "DEFAULT_LEDGER",
    "ActuatorConfig",
    "CommandSettings",
    "KubernetesSettings",
    "RestartSettings",
    "SlurmSettings",
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
    gpu_isolation: Literal["node", "device"] = "node"
    """How a fault of one GPU (``device_faults``, the command naming its GPU) is isolated.
    ``node``: cordon the node (all its GPUs out of service; clusters without DRA).
    ``device``: taint that one GPU with a DRA DeviceTaintRule (resource.k8s.io/v1,
    Kubernetes >= 1.37; apply compose/k8s/rbac-actuator-dra.yaml), so the node and its
    other GPUs keep working; a node whose ResourceSlices do not list the GPU is cordoned.
    ``c4stream actuate --check`` says whether the cluster serves DeviceTaintRules."""
    device_faults: tuple[Fault, ...] = ("straggler", "noncomm_hang")
    """Faults of one GPU: with ``gpu_isolation = "device"`` they taint the GPU; every
    other fault (NIC, link, communication hang) still cordons the node."""
    dra_driver: str = "gpu.nvidia.com"
    """The DRA driver whose ResourceSlices list the GPUs (NVIDIA's DRA driver)."""
    device_index_attribute: str = "index"
    """The device attribute holding the GPU's index on its node (the command's ``gpu``);
    qualified (``gpu.nvidia.com/index``) or not, as the driver publishes it."""


class CommandSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The command backend: argv templates run without a shell."""

    template: str | None = None
    """For ``cordon`` and ``cordon_and_taint``, e.g.
    ``scontrol update nodename={host} state=drain reason="{reason}"``."""
    restart_template: str | None = None
    """For ``restart_job``; None: restart_job commands are skipped (ledger ``skipped``,
    with the reason), so a template added later still acts on a redelivery."""
    timeout_s: float = 30.0
    fatal_patterns: tuple[str, ...] | None = None
    """Regular expressions: stderr matching one stops the actuator (permissions,
    configuration). None: scontrol's (``sinks.actuator.process.SLURM_FATAL``)."""
    permanent_patterns: tuple[str, ...] | None = None
    """stderr matching one fails this command at once (no such node). None: scontrol's."""
    idempotent: bool = False
    """The template deduplicates by ``C4STREAM_COMMAND_ID`` (or ``{id}``): after a crash
    between running it and recording it, run it again with the same id. False: such a
    command is not run again and ends ``unknown`` (sinks.actuator.recovery)."""


class SlurmSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The Slurm backend: ``scontrol`` run directly (no template, no shell)."""

    scontrol: str = "scontrol"
    """The program; a full path if it is not on PATH."""
    command_prefix: tuple[str, ...] = ()
    """argv put before ``scontrol``, e.g. ``["sudo", "-n", "-u", "slurm"]``: drains need
    SlurmUser, root or an Operator/Admin AdminLevel."""
    slurm_conf: str | None = None
    """Path given to scontrol as ``SLURM_CONF``; None: scontrol's own default."""
    timeout_s: float = 30.0
    reason_prefix: str = "c4stream"
    """c4stream's drain reasons read ``<prefix> <command id>: <reason>``; a node drained
    with any other reason is an administrator's and is never touched."""
    check_node: str | None = None
    """Node ``actuate --check`` shows; None: the first node slurmctld lists."""


class RestartSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Restart the job after its host was isolated (``sinks.actuator.restart``).

    Off by default and per job: only jobs matching ``jobs`` are ever restarted.
    """

    jobs: tuple[str, ...] = ()
    """Telemetry job names (shell patterns, ``llm-*``) whose job is restarted once one of
    its hosts was isolated; empty (the default): restart nothing."""
    execute: bool = False
    """Dry run first: False logs the restart it would do, even when isolations act."""
    max_per_hour: int = 2
    """At most this many restarts of one job per rolling hour."""
    in_progress_s: float = 900.0
    """A restart counts as in progress this long after it was issued: no second one."""
    faults: tuple[Fault, ...] = ("noncomm_hang", "comm_hang", "straggler", "slow_nic", "slow_link")
    """Fault classes whose isolation restarts the job."""
    requeue_template: str | None = None
    """Command backend: the argv template that restarts the job, e.g.
    ``scontrol requeue {jobid}``; the command backend's placeholders plus ``{jobid}``."""
    jobid_regex: str | None = None
    """Command backend: the scheduler job id from the telemetry's job name, a regex with
    a group ``jobid`` (``slurm-(?P<jobid>[0-9]+)``); searched, so it may match a part."""
    jobid_lookup: str | None = None
    """Command backend, when no regex is set: an argv template printing the job id(s) on
    the host, e.g. ``squeue -h -w {host} -n {job} -o %i`` (one id per line)."""
    status_template: str | None = None
    """Command backend: an argv template printing the job's state, e.g.
    ``squeue -h -j {jobid} -o %T``; a Slurm state such as PENDING, CONFIGURING or
    REQUEUED means a restart is in progress (none is started)."""
    pod_selector: str = "job-name={job}"
    """Kubernetes: label selector of the job's pods; ``{job}`` is the telemetry job name
    (a Job's pods carry ``job-name``; a PyTorchJob's ``training.kubeflow.org/job-name``;
    a JobSet's ``jobset.sigs.k8s.io/jobset-name``)."""
    namespace: str = "default"
    """Kubernetes: namespace of the job's pods (rbac-actuator-restart.yaml grants it)."""
    grace_period_s: int | None = None
    """Kubernetes: termination grace period of the evicted pods; None: the pod's own."""
    method: Literal["evict", "delete"] = "evict"
    """Kubernetes: ``evict`` (the Eviction API, policy/v1: PodDisruptionBudgets are
    respected and the pod gets the ``DisruptionTarget`` condition, which a Job's
    podFailurePolicy can ignore, so the restart costs no retry of its backoffLimit) or
    ``delete`` (a plain delete: counted as a failure; add verb delete on pods to
    rbac-actuator-restart.yaml)."""


class ActuatorConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything ``c4stream actuate`` needs; no other setting is read anywhere else."""

    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    group: str = "c4stream-actuator"
    backend: Literal["kubernetes", "command", "slurm"] = "kubernetes"
    execute: bool = False
    """False (the default): log exactly what would be done, do nothing."""
    check_at_start: bool = True
    """With ``execute``: run the backend's check (what ``--check`` prints) before
    consuming, and stop with status 2 if it fails."""
    deny: tuple[str, ...] = ()
    """Hosts never acted on; shell-style patterns (``login-*``), case-insensitive. They
    are matched against the host as the command names it and against its node name."""
    strip_domain: bool = False
    """Node name = the host name up to its first dot (``node-005.cluster.local`` →
    ``node-005``): schedulers and Kubernetes usually name nodes by short host name."""
    node_regex: str | None = None
    """A regular expression searched in the host name; its group ``node`` (or its first
    group, or the whole match) is the node name. Applied after ``strip_domain``; a host
    it does not match keeps its name."""
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
    instance_id: str | None = None
    """Static group membership (``group.instance.id``; default ``group@hostname``, ""
    for dynamic): a restarted actuator takes its partition back at once."""
    broker_timeout_s: float = 120.0
    """Exit non-zero when the broker stays unreachable this long (0: never)."""
    status_file: str = ""
    """Write the actuator's status JSON here every second ("": no file)."""
    exit_when_idle_s: float | None = None
    """Stop after this long without a message (batch runs and tests); None: run on."""
    max_messages: int | None = None
    isolations: str | None = None
    """Topic override; None: ``Topics(prefix=kafka.topic_prefix).isolations``."""
    deadletter: str | None = None
    actions: str | None = None
    """Where outcomes are published (the alerter shows them); None: ``c4.actions``."""
    publish_outcomes: bool = True
    """Publish one record per handled command to the actions topic."""
    require_signed_commands: bool = False
    """Act only on commands signed by the worker (header ``c4-sig`` under the commands
    key, docs/security.md); others are refused: dead-lettered, reported ``denied``."""
    command_key_files: tuple[str, ...] = ()
    """The commands key file(s) (``c4stream keys derive --commands``); several during a
    rotation. The actuator never needs the master key."""
    kubernetes: KubernetesSettings = msgspec.field(default_factory=KubernetesSettings)
    command: CommandSettings = msgspec.field(default_factory=CommandSettings)
    slurm: SlurmSettings = msgspec.field(default_factory=SlurmSettings)
    restart: RestartSettings = msgspec.field(default_factory=RestartSettings)

    def __post_init__(self) -> None:
        if self.require_signed_commands and not self.command_key_files:
            raise ValueError(
                "require_signed_commands = true needs command_key_files "
                "(c4stream keys derive --commands, docs/security.md)"
            )
        load_keys(self.command_key_files)  # missing, short, readable by others: say so now
        if self.node_regex is not None:
            try:
                re.compile(self.node_regex)
            except re.error as err:
                raise ValueError(f"node_regex {self.node_regex!r}: {err}") from None

    def topics(self) -> Topics:
        return Topics(prefix=self.kafka.topic_prefix)

    def isolations_topic(self) -> str:
        return self.isolations or self.topics().isolations

    def deadletter_topic(self) -> str:
        return self.deadletter or self.topics().deadletter

    def actions_topic(self) -> str:
        return self.actions or self.topics().actions

    def node_name(self, host: str) -> str:
        """The scheduler's / Kubernetes' node name for a host (``strip_domain``, ``node_regex``)."""
        name = host.split(".", 1)[0] if self.strip_domain else host
        if self.node_regex is not None:
            m = re.search(self.node_regex, name)
            if m is not None:
                if "node" in m.re.groupindex:
                    name = m.group("node")
                elif m.re.groups:
                    name = m.group(1)
                else:
                    name = m.group(0)
        return name

    def deny_pattern(self, host: str) -> str | None:
        """The first deny pattern matching ``host`` or its node name (case-insensitive)."""
        names = {host.lower(), self.node_name(host).lower()}
        return next((p for p in self.deny if any(fnmatchcase(n, p.lower()) for n in names)), None)

    def is_denied(self, host: str) -> bool:
        """Whether ``host`` (or its node name) matches a deny pattern."""
        return self.deny_pattern(host) is not None


ACTUATOR_SECTION = Section(ActuatorConfig)
"""``[actuator]`` of ``c4stream.toml``."""
