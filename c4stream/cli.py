"""The ``c4stream`` command: a thin front end; each stage registers its own commands.

producers: simulate, exporter, replay · streams: detect, worker ·
sinks: actuate, archive, alert · compose: broker · demo, config
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

import compose.cli
import producers.cli
import sinks.cli
import streams.cli
from c4base.cli_options import fail

# Each command imports what it runs inside its function: `c4stream --help` and a
# `c4stream detect` on a dump directory must not wait for river, Faust, matplotlib or the
# Kubernetes client (tests/test_cli_imports.py checks which modules each one loads).

app = typer.Typer(
    name="c4stream",
    help=(
        "Find the faulty GPU, NIC, link or process of a distributed training job from "
        "its collective-communication telemetry, and take it out."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    # Help texts name TOML tables such as [kafka]: rich markup would swallow them.
    rich_markup_mode=None,
)

for stage in (producers.cli, streams.cli, sinks.cli, compose.cli):
    stage.register(app)


config_app = typer.Typer(help="Check or print the configuration file (c4stream.toml).")
app.add_typer(config_app, name="config")


@config_app.command("check")
def config_check(
    path: Path = typer.Argument(..., help="The TOML file to validate.", exists=False),
) -> None:
    """Validate every table of a configuration file with the types the services use.

    Environment overrides (C4STREAM__SECTION__KEY=value) are applied first, as the
    services do. Exit status 1 when anything is wrong.
    """
    from rich.console import Console
    from rich.markup import escape

    from c4base.settings_loader import SettingsError
    from c4stream.config import check_config
    from c4stream.config_warnings import config_warnings

    console = Console()
    try:
        reports = check_config(path)
    except SettingsError as err:
        console.print(f"[red]error:[/] {err}")
        raise typer.Exit(1) from None
    for r in reports:
        mark = "[green]  ok [/]" if r.ok else "[red]error[/]"
        console.print(f"{mark} {escape(f'[{r.section}]')} {'' if r.ok else escape(r.message)}")
    for w in config_warnings(path, env=os.environ):
        console.print(f"[yellow] warn[/] {escape(f'[{w.section}]')} {escape(w.message)}")
    if not all(r.ok for r in reports):
        raise typer.Exit(1)
    console.print(f"{path}: {len(reports)} tables, all valid")


keys_app = typer.Typer(
    help="Keys that sign events and commands (docs/security.md, 'Signed messages')."
)
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(
    out: Path = typer.Option(
        ..., "--out", help="New master key file (mode 0600; never overwritten)."
    ),
) -> None:
    """Write a new random master key (32 bytes, hex). Keep it with the worker only."""
    from c4base.signing import KeyFileError, generate_key_file

    try:
        generate_key_file(out)
    except KeyFileError as err:
        fail("keys generate", err, 2)
    typer.echo(f"wrote master key {out} (mode 0600)", err=True)


@keys_app.command("derive")
def keys_derive(
    master: Path = typer.Option(..., "--master", help="The master key file."),
    host: str | None = typer.Option(None, "--host", help="Derive this exporter host's key."),
    commands: bool = typer.Option(False, "--commands", help="Derive the commands key."),
    out: Path | None = typer.Option(
        None, "--out", help="Write the key here (mode 0600); default: print it."
    ),
) -> None:
    """Derive one host's exporter key (--host H) or the actuator's commands key
    (--commands) from the master key: each host holds only its own key."""
    if (host is None) == (not commands):
        fail("keys derive", "give exactly one of --host H or --commands", 2)
    from c4base.signing import SigningError, commands_key, host_key, load_key, write_key_file

    try:
        m = load_key(master)
        key = commands_key(m) if commands else host_key(m, host or "")
        if out is None:
            typer.echo(key.hex())
        else:
            write_key_file(out, key)
            typer.echo(f"wrote {'commands' if commands else host} key {out} (mode 0600)", err=True)
    except SigningError as err:
        fail("keys derive", err, 2)


@config_app.command("example")
def config_example() -> None:
    """Print a commented example configuration with every table."""
    from importlib.resources import files

    typer.echo(files("c4stream").joinpath("example.toml").read_text(), nl=False)


@app.command()
def demo(
    out: Path = typer.Option(
        Path("demo-out"), "--out", help="Where the trace, archive, report and logs go."
    ),
    gpus: int = typer.Option(128, "--gpus", min=16, help="GPUs in the simulated job."),
    scenario: str = typer.Option(
        "demo", "--scenario", help="Simulator scenario (see `c4stream simulate --list`)."
    ),
    seed: int = typer.Option(0, "--seed"),
    speed: float = typer.Option(
        6.0, "--speed", min=0.1, help="Trace seconds replayed per wall second."
    ),
    bootstrap: str | None = typer.Option(
        None,
        "--bootstrap",
        envvar="KAFKA_BOOTSTRAP",
        help="Use this Kafka cluster instead of starting a local broker.",
    ),
) -> None:
    """Run the whole pipeline on a simulated job with injected faults, and show what it finds.

    Starts a local Kafka broker (or uses --bootstrap), the worker, the archiver, the
    actuator (dry run) and the alerter (posting to a local receiver), replays a
    simulated 128-GPU job, shows decisions live, stops everything and writes
    OUT/report.html and the Parquet archive OUT/archive.
    """
    from c4stream.demo.run import DemoConfig, run_demo

    result = run_demo(
        DemoConfig(
            out_dir=out, gpus=gpus, scenario=scenario, seed=seed, speed=speed, bootstrap=bootstrap
        )
    )
    if result.matched < len(result.truth.get("faults", [])) or result.false_isolations:
        raise typer.Exit(1)


def main() -> None:
    app()
