"""The ``c4stream`` command: a thin front end; each stage registers its own commands.

producers: simulate, exporter, replay · streams: detect, worker ·
sinks: actuate, archive, alert · compose: broker · demo, config
"""

from __future__ import annotations

import typer

import compose.cli
import producers.cli
import sinks.cli
import streams.cli

app = typer.Typer(
    name="c4stream",
    help=(
        "Find the faulty GPU, NIC, link or process of a distributed training job from "
        "its collective-communication telemetry, and take it out."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

for stage in (producers.cli, streams.cli, sinks.cli, compose.cli):
    stage.register(app)


def main() -> None:
    app()
