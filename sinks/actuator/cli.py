"""``c4stream actuate``: the command-line front end of the actuator.

Registered by :mod:`sinks.cli`. Only typer, msgspec and the config are imported at
module level, so ``c4stream --help`` stays fast; the Kafka and Kubernetes clients are
imported when the command runs.
"""

from __future__ import annotations

import enum
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from c4base.config import flag_overrides, load_section
from c4base.service import LOG_JSON_HELP, METRICS_HOST_HELP, METRICS_PORT_HELP, start_service
from c4base.settings_loader import SettingsError
from sinks.actuator.backends import ActuatorError
from sinks.actuator.command_backend import CommandBackend
from sinks.actuator.config import ACTUATOR_SECTION, DEFAULT_LEDGER, ActuatorConfig
from sinks.actuator.consumer import run
from sinks.actuator.kubernetes_backend import KubernetesBackend, load_api_client
from sinks.actuator.ledger import Ledger
from sinks.actuator.slurm_backend import SlurmBackend

if TYPE_CHECKING:
    from sinks.actuator.backends import Backend

__all__ = ["actuate", "make_backend"]

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
    "--command-template 'mysched drain {host} --why \"{reason}\"'"
)


class BackendName(enum.StrEnum):
    kubernetes = "kubernetes"
    command = "command"
    slurm = "slurm"


class Effect(enum.StrEnum):
    NoExecute = "NoExecute"
    NoSchedule = "NoSchedule"


def actuate(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option("--config", help="c4stream.toml ([kafka], [actuator]); flags win over it."),
    ] = None,
    bootstrap: Annotated[
        str, typer.Option("--bootstrap", "-b", help="Kafka bootstrap; KAFKA_BOOTSTRAP overrides.")
    ] = "127.0.0.1:9092",
    backend: Annotated[BackendName, typer.Option("--backend")] = BackendName.kubernetes,
    execute: Annotated[
        bool,
        typer.Option(
            "--execute", help="Really act. Without it: log what would be done, do nothing."
        ),
    ] = False,
    deny: Annotated[
        list[str] | None,
        typer.Option(
            "--deny",
            help="Host never acted on; shell patterns allowed (login-*); repeat or comma-separate.",
        ),
    ] = None,
    ledger: Annotated[
        Path,
        typer.Option(
            "--ledger",
            help="SQLite file of command ids already acted on (keep it on a persistent disk).",
        ),
    ] = Path(DEFAULT_LEDGER),
    command_template: Annotated[
        str | None,
        typer.Option(
            "--command-template",
            help="Command backend: argv template for cordon/cordon_and_taint; placeholders "
            "{host} {reason} {fault} {gpu} {nic} {id} {job} {action} {peer_host} {confidence}.",
        ),
    ] = None,
    restart_command_template: Annotated[
        str | None,
        typer.Option(
            "--restart-command-template", help="Command backend: template for restart_job."
        ),
    ] = None,
    command_timeout: Annotated[
        float, typer.Option("--command-timeout", help="Seconds before a command is killed.")
    ] = 30.0,
    slurm_conf: Annotated[
        str | None,
        typer.Option("--slurm-conf", help="Slurm backend: slurm.conf for scontrol (SLURM_CONF)."),
    ] = None,
    strip_domain: Annotated[
        bool,
        typer.Option(
            "--strip-domain", help="Node name = host name up to the first dot (n5.example → n5)."
        ),
    ] = False,
    node_regex: Annotated[
        str | None,
        typer.Option(
            "--node-regex",
            help="Regex searched in the host name; its group 'node' (or first group) is the "
            "node name.",
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Verify the backend can act (Slurm: scontrol ping, show node, user; "
            "Kubernetes: the RBAC it needs), print the result and exit (2 on failure).",
        ),
    ] = False,
    kubeconfig: Annotated[
        str | None, typer.Option("--kubeconfig", help="Default: $KUBECONFIG or ~/.kube/config.")
    ] = None,
    context: Annotated[str | None, typer.Option("--context", help="kubeconfig context.")] = None,
    in_cluster: Annotated[
        bool,
        typer.Option(
            "--in-cluster", help="Use the pod's service account (compose/k8s/rbac-actuator.yaml)."
        ),
    ] = False,
    taint_key: Annotated[str, typer.Option("--taint-key")] = "c4stream.io/fault",
    cordon_and_taint_effect: Annotated[
        Effect,
        typer.Option(
            "--cordon-and-taint-effect",
            help="Taint effect for cordon_and_taint (cordon uses NoSchedule).",
        ),
    ] = Effect.NoExecute,
    event_namespace: Annotated[str, typer.Option("--event-namespace")] = "default",
    attempts: Annotated[int, typer.Option("--attempts", help="Tries of a failing action.")] = 3,
    retry_backoff: Annotated[
        float, typer.Option("--retry-backoff", help="First retry pause, s.")
    ] = 1.0,
    group: Annotated[
        str, typer.Option("--group", help="Kafka consumer group.")
    ] = "c4stream-actuator",
    topic_prefix: Annotated[str, typer.Option("--topic-prefix")] = "",
    isolations_topic: Annotated[str | None, typer.Option("--isolations-topic")] = None,
    deadletter_topic: Annotated[str | None, typer.Option("--deadletter-topic")] = None,
    exit_when_idle: Annotated[
        float | None,
        typer.Option("--exit-when-idle", help="Stop after this many seconds without a message."),
    ] = None,
    max_messages: Annotated[int | None, typer.Option("--max-messages")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    metrics_port: Annotated[int, typer.Option("--metrics-port", help=METRICS_PORT_HELP)] = 0,
    metrics_host: Annotated[
        str, typer.Option("--metrics-host", help=METRICS_HOST_HELP)
    ] = "127.0.0.1",
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING…")] = "INFO",
    log_json: Annotated[bool, typer.Option("--log-json", help=LOG_JSON_HELP)] = False,
) -> None:

    # Flags given on the command line win over the file; the file over the defaults.
    flags = flag_overrides(
        ctx,
        _FLAG_KEYS,
        deny=[h.strip() for d in deny or () for h in d.split(",") if h.strip()],
    )
    try:
        svc = start_service(
            config, ctx, stage="actuator", log_values={"log_level": "DEBUG"} if verbose else None
        )
        cfg: ActuatorConfig = load_section("actuator", ACTUATOR_SECTION, config, overrides=flags)
    except SettingsError as err:
        typer.echo(f"c4stream actuate: {err}", err=True)
        raise typer.Exit(2) from None
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()  # finish the command at hand, commit, leave the group

    if check:
        try:
            be = make_backend(cfg, check_programs=True)
            for line in be.check():
                typer.echo(line)
        except ActuatorError as err:
            typer.echo(f"c4stream actuate --check: FAILED: {err}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"c4stream actuate --check: backend {be.name} ok")
        return
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        be = make_backend(cfg)
        if cfg.execute and cfg.check_at_start:
            for line in be.check():  # fail before consuming, not on the first command
                svc.log.info("check: %s", line)
        with Ledger(cfg.ledger_path, retention_days=cfg.ledger_retention_days) as led:
            stats = run(cfg, be, led, stop=stop, metrics=svc.metrics)
    except ActuatorError as err:
        # Fatal for the service (permissions, configuration): stop loudly; the message
        # at hand was not committed and is delivered again after the fix.
        typer.echo(f"c4stream actuate: stopped: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"c4stream actuate: {stats}", err=True)


#: Option parameter -> key of the [actuator] table.
_FLAG_KEYS = {
    "bootstrap": "kafka.bootstrap",
    "topic_prefix": "kafka.topic_prefix",
    "group": "group",
    "backend": "backend",
    "execute": "execute",
    "deny": "deny",
    "ledger": "ledger_path",
    "attempts": "attempts",
    "retry_backoff": "retry_backoff_s",
    "exit_when_idle": "exit_when_idle_s",
    "max_messages": "max_messages",
    "isolations_topic": "isolations",
    "deadletter_topic": "deadletter",
    "kubeconfig": "kubernetes.kubeconfig",
    "context": "kubernetes.context",
    "in_cluster": "kubernetes.in_cluster",
    "taint_key": "kubernetes.taint_key",
    "cordon_and_taint_effect": "kubernetes.cordon_and_taint_effect",
    "event_namespace": "kubernetes.event_namespace",
    "command_template": "command.template",
    "restart_command_template": "command.restart_template",
    "command_timeout": "command.timeout_s",
    "slurm_conf": "slurm.slurm_conf",
    "strip_domain": "strip_domain",
    "node_regex": "node_regex",
}


def make_backend(cfg: ActuatorConfig, *, check_programs: bool | None = None) -> Backend:
    """The configured backend; with --execute (or ``check_programs``) it checks it can
    really act (fail fast)."""
    real = cfg.execute if check_programs is None else check_programs
    if cfg.backend == "command":
        return CommandBackend(cfg.command, check_programs=real)
    if cfg.backend == "slurm":
        return SlurmBackend(cfg.slurm, check_programs=real)

    client = load_api_client(cfg.kubernetes) if real else None
    return KubernetesBackend(cfg.kubernetes, client)


actuate.__doc__ = _HELP
