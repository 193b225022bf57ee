"""``c4stream actuate``: the command-line front end of the actuator.

Registered by :mod:`sinks.cli`. Only typer and the shared options are imported at
module level, so ``c4stream --help`` stays fast; the actuator itself, the Kafka and
Kubernetes clients are imported when the command runs.
"""

from __future__ import annotations

import enum
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from c4base.cli_options import (
    Bootstrap,
    BrokerTimeout,
    Group,
    InstanceId,
    Key,
    LogJson,
    LogLevel,
    MetricsHost,
    MetricsPort,
    StatusFile,
    TopicPrefix,
    config_file,
    fail,
    given,
)

if TYPE_CHECKING:
    from sinks.actuator.backends import Backend
    from sinks.actuator.config import ActuatorConfig
    from sinks.actuator.restart import Restarter

ConfigFile = config_file("[kafka], [actuator]")

__all__ = ["actuate", "make_backend", "make_restarter", "restart_summary"]

_HELP = (
    "Act on isolation commands from c4.isolations: cordon and taint Kubernetes nodes, "
    "drain Slurm nodes, or run a scheduler command.\n\n"
    "DRY-RUN BY DEFAULT, TWO SWITCHES: it acts only with --execute AND when the command "
    "is not marked dry_run by the worker ([worker.policy] dry_run, true by default); "
    "otherwise it logs exactly what it would do and names the switch that held it back. "
    "Never on a host in the deny list; never for action alert_only; at most once per "
    "command id, also across restarts (the --ledger file). Permission and configuration "
    "errors stop it with exit status 2; check first with --check.\n\n"
    "Examples:\n\n"
    "c4stream actuate --backend kubernetes --kubeconfig ~/.kube/config --check\n\n"
    "c4stream actuate --backend slurm --strip-domain --execute --deny 'login-*'\n\n"
    "c4stream actuate --backend command --execute "
    "--command-template 'mysched drain {host} --why \"{reason}\"'\n\n"
    "RESTART AFTER ISOLATION is off by default and per job: --restart-jobs 'llm-*' restarts "
    "(dry run until --restart-execute) the job of a host once it was isolated, e.g. "
    "--requeue-template 'scontrol requeue {jobid}' --jobid-lookup 'squeue -h -w {host} -n "
    "{job} -o %i'; on Kubernetes it evicts the job's pods on the node (--restart-pod-selector)."
)


class BackendName(enum.StrEnum):
    kubernetes = "kubernetes"
    command = "command"
    slurm = "slurm"


class Effect(enum.StrEnum):
    NoExecute = "NoExecute"
    NoSchedule = "NoSchedule"


class GpuIsolation(enum.StrEnum):
    node = "node"
    device = "device"


def actuate(
    ctx: typer.Context,
    config: ConfigFile = None,
    bootstrap: Bootstrap = None,
    backend: Annotated[
        BackendName, typer.Option("--backend"), Key("backend")
    ] = BackendName.kubernetes,
    execute: Annotated[
        bool,
        typer.Option(
            "--execute", help="Really act. Without it: log what would be done, do nothing."
        ),
        Key("execute"),
    ] = False,
    deny: Annotated[
        list[str] | None,
        typer.Option(
            "--deny",
            help="Host never acted on; shell patterns allowed (login-*); repeat or comma-separate.",
        ),
        Key("deny"),
    ] = None,
    ledger: Annotated[
        Path | None,
        typer.Option(
            "--ledger",
            help="SQLite file of command ids already acted on (keep it on a persistent disk); "
            "default: [actuator] ledger_path.",
        ),
        Key("ledger_path"),
    ] = None,
    command_template: Annotated[
        str | None,
        typer.Option(
            "--command-template",
            help="Command backend: argv template for cordon/cordon_and_taint; placeholders "
            "{host} {reason} {fault} {gpu} {nic} {id} {job} {action} {peer_host} {confidence}.",
        ),
        Key("command.template"),
    ] = None,
    restart_command_template: Annotated[
        str | None,
        typer.Option(
            "--restart-command-template", help="Command backend: template for restart_job."
        ),
        Key("command.restart_template"),
    ] = None,
    command_timeout: Annotated[
        float,
        typer.Option("--command-timeout", help="Seconds before a command is killed."),
        Key("command.timeout_s"),
    ] = 30.0,
    slurm_conf: Annotated[
        str | None,
        typer.Option("--slurm-conf", help="Slurm backend: slurm.conf for scontrol (SLURM_CONF)."),
        Key("slurm.slurm_conf"),
    ] = None,
    strip_domain: Annotated[
        bool,
        typer.Option(
            "--strip-domain", help="Node name = host name up to the first dot (n5.example → n5)."
        ),
        Key("strip_domain"),
    ] = False,
    node_regex: Annotated[
        str | None,
        typer.Option(
            "--node-regex",
            help="Regex searched in the host name; its group 'node' (or first group) is the "
            "node name.",
        ),
        Key("node_regex"),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Verify the backend can act (Slurm: scontrol ping, show node, user; "
            "Kubernetes: every permission the configured features need, restart and DRA "
            "device taints included, naming the manifest that grants a missing one), print "
            "the result and exit (2 on failure).",
        ),
    ] = False,
    kubeconfig: Annotated[
        str | None,
        typer.Option("--kubeconfig", help="Default: $KUBECONFIG or ~/.kube/config."),
        Key("kubernetes.kubeconfig"),
    ] = None,
    context: Annotated[
        str | None, typer.Option("--context", help="kubeconfig context."), Key("kubernetes.context")
    ] = None,
    in_cluster: Annotated[
        bool,
        typer.Option(
            "--in-cluster", help="Use the pod's service account (compose/k8s/rbac-actuator.yaml)."
        ),
        Key("kubernetes.in_cluster"),
    ] = False,
    taint_key: Annotated[
        str, typer.Option("--taint-key"), Key("kubernetes.taint_key")
    ] = "c4stream.io/fault",
    cordon_and_taint_effect: Annotated[
        Effect,
        typer.Option(
            "--cordon-and-taint-effect",
            help="Taint effect for cordon_and_taint (cordon uses NoSchedule).",
        ),
        Key("kubernetes.cordon_and_taint_effect"),
    ] = Effect.NoExecute,
    event_namespace: Annotated[
        str, typer.Option("--event-namespace"), Key("kubernetes.event_namespace")
    ] = "default",
    gpu_isolation: Annotated[
        GpuIsolation,
        typer.Option(
            "--gpu-isolation",
            help="Kubernetes: a one-GPU fault cordons the node (node) or taints only that GPU "
            "with a DRA DeviceTaintRule (device; Kubernetes >= 1.37, rbac-actuator-dra.yaml). "
            "--check says whether the cluster serves them.",
        ),
        Key("kubernetes.gpu_isolation"),
    ] = GpuIsolation.node,
    restart_jobs: Annotated[
        list[str] | None,
        typer.Option(
            "--restart-jobs",
            help="Restart these jobs (telemetry job names, shell patterns; repeat or "
            "comma-separate) once one of their hosts was isolated. Default: none.",
        ),
        Key("restart.jobs"),
    ] = None,
    restart_execute: Annotated[
        bool,
        typer.Option("--restart-execute", help="Really restart (else: log what would be done)."),
        Key("restart.execute"),
    ] = False,
    restart_max_per_hour: Annotated[
        int,
        typer.Option("--restart-max-per-hour", help="Restarts per job per rolling hour."),
        Key("restart.max_per_hour"),
    ] = 2,
    restart_in_progress: Annotated[
        float,
        typer.Option("--restart-in-progress", help="Seconds a restart counts as in progress."),
        Key("restart.in_progress_s"),
    ] = 900.0,
    requeue_template: Annotated[
        str | None,
        typer.Option(
            "--requeue-template",
            help="Command backend: argv template restarting the job, e.g. "
            "'scontrol requeue {jobid}' ({jobid} and the command placeholders).",
        ),
        Key("restart.requeue_template"),
    ] = None,
    jobid_regex: Annotated[
        str | None,
        typer.Option(
            "--jobid-regex",
            help="Scheduler job id from the telemetry job name: a regex with a group "
            "jobid, e.g. 'slurm-(?P<jobid>[0-9]+)'.",
        ),
        Key("restart.jobid_regex"),
    ] = None,
    jobid_lookup: Annotated[
        str | None,
        typer.Option(
            "--jobid-lookup",
            help="Or ask the scheduler: argv template printing the job id, e.g. "
            "'squeue -h -w {host} -n {job} -o %i'.",
        ),
        Key("restart.jobid_lookup"),
    ] = None,
    restart_status_template: Annotated[
        str | None,
        typer.Option(
            "--restart-status-template",
            help="Command backend: argv template printing the job's Slurm state, e.g. "
            "'squeue -h -j {jobid} -o %T'; PENDING, REQUEUED… = a restart is in progress.",
        ),
        Key("restart.status_template"),
    ] = None,
    restart_pod_selector: Annotated[
        str,
        typer.Option(
            "--restart-pod-selector", help="Kubernetes: label selector of the job's pods."
        ),
        Key("restart.pod_selector"),
    ] = "job-name={job}",
    restart_namespace: Annotated[
        str,
        typer.Option("--restart-namespace", help="Kubernetes: namespace of the job's pods."),
        Key("restart.namespace"),
    ] = "default",
    attempts: Annotated[
        int, typer.Option("--attempts", help="Tries of a failing action."), Key("attempts")
    ] = 3,
    retry_backoff: Annotated[
        float, typer.Option("--retry-backoff", help="First retry pause, s."), Key("retry_backoff_s")
    ] = 1.0,
    group: Group = None,
    instance_id: InstanceId = None,
    broker_timeout: BrokerTimeout = None,
    status_file: StatusFile = None,
    topic_prefix: TopicPrefix = None,
    isolations_topic: Annotated[
        str | None, typer.Option("--isolations-topic"), Key("isolations")
    ] = None,
    deadletter_topic: Annotated[
        str | None, typer.Option("--deadletter-topic"), Key("deadletter")
    ] = None,
    exit_when_idle: Annotated[
        float | None,
        typer.Option("--exit-when-idle", help="Stop after this many seconds without a message."),
        Key("exit_when_idle_s"),
    ] = None,
    max_messages: Annotated[int | None, typer.Option("--max-messages"), Key("max_messages")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    metrics_port: MetricsPort = None,
    metrics_host: MetricsHost = None,
    log_level: LogLevel = None,
    log_json: LogJson = False,
) -> None:

    from c4base.config import load_section
    from c4base.lifeguard import stop_on_signals
    from c4base.runtime import FatalError
    from c4base.service import start_service
    from c4base.settings_loader import SettingsError
    from sinks.actuator.backends import ActuatorConfigError, ActuatorError
    from sinks.actuator.config import ACTUATOR_SECTION
    from sinks.actuator.consumer import run
    from sinks.actuator.ledger import Ledger
    from sinks.actuator.restart import RestartHook, RestartLog
    from sinks.actuator.restart_kubernetes import KubernetesRestarter

    # Flags given on the command line win over the file; the file over the defaults.
    flags = given(
        ctx,
        actuate,
        deny=[h.strip() for d in deny or () for h in d.split(",") if h.strip()],
        restart_jobs=[j.strip() for r in restart_jobs or () for j in r.split(",") if j.strip()],
    )
    try:
        svc = start_service(
            config, ctx, stage="actuator", log_values={"log_level": "DEBUG"} if verbose else None
        )
        cfg: ActuatorConfig = load_section("actuator", ACTUATOR_SECTION, config, overrides=flags)
    except SettingsError as err:
        fail("actuate", err, 2)
    stop = threading.Event()  # SIGTERM: finish the command at hand, commit, leave the group

    if check:
        try:
            be = make_backend(cfg, check_programs=True)
            for line in be.check():
                typer.echo(line)
        except ActuatorError as err:
            fail("actuate --check", f"FAILED: {err}", 2)
        typer.echo(f"c4stream actuate --check: backend {be.name} ok")
        try:
            restarter = make_restarter(cfg, check_programs=True)
            if isinstance(restarter, KubernetesRestarter):
                for line in restarter.check():  # its RBAC is a manifest of its own
                    typer.echo(line)
        except ActuatorError as err:
            fail("actuate --check", f"restart FAILED: {err}", 2)
        typer.echo(f"c4stream actuate --check: {restart_summary(cfg, restarter)}")
        return
    stop_on_signals(stop)
    try:
        be = make_backend(cfg)
        if cfg.execute and cfg.check_at_start:
            for line in be.check():  # fail before consuming, not on the first command
                svc.log.info("check: %s", line)
        restarter = make_restarter(cfg)
        if (
            cfg.execute
            and cfg.check_at_start
            and cfg.restart.execute
            and isinstance(restarter, KubernetesRestarter)
        ):
            for line in restarter.check():  # its RBAC too, before the first restart needs it
                svc.log.info("check: %s", line)
        with (
            Ledger(cfg.ledger_path, retention_days=cfg.ledger_retention_days) as led,
            RestartLog(cfg.ledger_path, retention_days=cfg.ledger_retention_days) as restarts,
        ):
            hook = None
            if restarter is not None:
                hook = RestartHook(
                    cfg.restart,
                    restarter,
                    restarts,
                    attempts=cfg.attempts,
                    retry_backoff_s=cfg.retry_backoff_s,
                    stop=stop,
                )
            stats = run(cfg, be, led, stop=stop, metrics=svc.metrics, restart=hook)
    except ActuatorConfigError as err:
        # Permissions, configuration: fix and restart; the command at hand is delivered again.
        fail("actuate", f"stopped: {err}", 2)
    except FatalError as err:
        # Fatal for the service (permissions, configuration, an undelivered dead letter,
        # the broker gone): the message at hand was not committed; it is delivered again.
        fail("actuate", f"stopped: {err}", 1)
    typer.echo(f"c4stream actuate: {stats}", err=True)


def make_backend(cfg: ActuatorConfig, *, check_programs: bool | None = None) -> Backend:
    """The configured backend; with --execute (or ``check_programs``) it checks it can
    really act (fail fast)."""
    from sinks.actuator.command_backend import CommandBackend
    from sinks.actuator.kubernetes_backend import KubernetesBackend, load_api_client
    from sinks.actuator.slurm_backend import SlurmBackend

    real = cfg.execute if check_programs is None else check_programs
    if cfg.backend == "command":
        return CommandBackend(cfg.command, check_programs=real)
    if cfg.backend == "slurm":
        return SlurmBackend(cfg.slurm, check_programs=real)

    client = load_api_client(cfg.kubernetes) if real else None
    return KubernetesBackend(cfg.kubernetes, client)


def make_restarter(cfg: ActuatorConfig, *, check_programs: bool | None = None) -> Restarter | None:
    """The restarter of the configured backend; None when no job is to be restarted.
    With --execute and --restart-execute (or ``check_programs``) its programs must exist."""
    from sinks.actuator.kubernetes_backend import load_api_client
    from sinks.actuator.restart_command import CommandRestarter, slurm_restarter
    from sinks.actuator.restart_kubernetes import KubernetesRestarter

    if not cfg.restart.jobs:
        return None
    live = (cfg.execute and cfg.restart.execute) if check_programs is None else check_programs
    if cfg.backend == "command":
        return CommandRestarter(cfg.command, cfg.restart, check_programs=live)
    if cfg.backend == "slurm":
        return slurm_restarter(cfg.slurm, cfg.restart, check_programs=live)
    client = load_api_client(cfg.kubernetes) if cfg.execute or check_programs else None
    return KubernetesRestarter(cfg.restart, cfg.kubernetes, client)


def restart_summary(cfg: ActuatorConfig, restarter: Restarter | None) -> str:
    """One line for ``--check``: whether and how jobs are restarted after an isolation."""
    r = cfg.restart
    if restarter is None:
        return "restart after isolation: off ([actuator.restart] jobs is empty)"
    mode = "executes" if cfg.execute and r.execute else "dry run"
    return (
        f"restart after isolation: jobs {', '.join(r.jobs)} via {restarter.name} ({mode}); "
        f"at most {r.max_per_hour} per job per hour, none within {r.in_progress_s:g} s "
        "of the last"
    )


actuate.__doc__ = _HELP
