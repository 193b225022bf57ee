"""``c4stream broker …``: run the no-Docker local Kafka broker from the command line."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType

import typer

broker_app = typer.Typer(
    name="broker",
    help="A local single-node Apache Kafka (KRaft) broker that needs Java 17+, not Docker.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    """Add the ``broker`` command group to the main ``c4stream`` CLI."""
    app.add_typer(broker_app, name="broker")


class _Stop(Exception):
    """Raised from the SIGTERM handler so `start` leaves through its cleanup."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Stop


_START_HELP = (
    "Start the local broker, print its bootstrap address, run until Ctrl-C or SIGTERM.\n\n"
    "The first run fetches Kafka's jars with Maven into the cache (see `broker fetch`). "
    "Data lives in a temp dir that is deleted on exit, or with --data DIR in DIR, kept: "
    "starting again with the same --data restarts the same broker (same port, cluster, "
    "topics, messages and committed offsets).\n\n"
    "Point the other commands at it with KAFKA_BOOTSTRAP=<printed address>."
)
_FETCH_HELP = (
    "Fetch Kafka's jars with Maven (once) and print the cache path.\n\n"
    "The cache is $C4STREAM_CACHE/kafka-<version>/libs, by default "
    "~/.cache/c4stream/kafka-<version>/libs. Needs `mvn` and `java` "
    "(apt: openjdk-17-jre-headless maven)."
)


@broker_app.command("start", help=_START_HELP)
def start(
    port: int = typer.Option(
        0, "--port", "-p", help="Client (PLAINTEXT) port on 127.0.0.1; 0 picks a free one."
    ),
    startup_timeout: float = typer.Option(
        60.0, "--startup-timeout", help="Seconds to wait for the broker to answer."
    ),
    data: Path | None = typer.Option(
        None, "--data", help="Keep the broker's data in DIR; a later start on DIR resumes it."
    ),
) -> None:
    """Run the local broker in the foreground (help text: _START_HELP)."""
    from compose.local_broker import BrokerError, LocalKafka

    signal.signal(signal.SIGTERM, _on_sigterm)
    kafka = LocalKafka(port=port, startup_timeout=startup_timeout, data_dir=data)
    try:
        kafka.start()
        typer.echo(kafka.bootstrap)  # stdout: just the address, easy to capture
        typer.echo(
            f"Kafka {kafka.version} ready; export KAFKA_BOOTSTRAP={kafka.bootstrap}\n"
            f"log: {kafka.log_file}\nCtrl-C to stop.",
            err=True,
        )
        while kafka.is_running():
            time.sleep(0.5)
        typer.echo(f"Kafka exited unexpectedly; log tail:\n{kafka.log_tail()}", err=True)
        raise typer.Exit(1)
    except BrokerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    except (KeyboardInterrupt, _Stop):
        typer.echo("stopping Kafka…", err=True)
    finally:
        kafka.stop()


@broker_app.command("fetch", help=_FETCH_HELP)
def fetch(
    force: bool = typer.Option(False, "--force", help="Fetch again even if cached."),
) -> None:
    """Fetch the jars only (help text: _FETCH_HELP)."""
    from compose.local_broker import KAFKA_VERSION, BrokerError, fetch_jars

    try:
        typer.echo(str(fetch_jars(KAFKA_VERSION, force=force)))
    except BrokerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


if __name__ == "__main__":  # python -m compose.cli, until the main CLI wires it in
    _app = typer.Typer()
    register(_app)
    _app()
