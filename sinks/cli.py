"""Command-line commands of the sinks stage; registered on the main app by :mod:`c4stream.cli`.

Heavy imports stay inside the command functions so that `c4stream --help` is fast.
"""

from __future__ import annotations

import typer

from sinks.actuator.cli import actuate
from sinks.alert.cli import alert_app
from sinks.archive.cli import app as archive_app


def register(app: typer.Typer) -> None:
    """Add this stage's commands to the main ``c4stream`` app."""

    app.add_typer(archive_app, name="archive")

    app.command("actuate")(actuate)

    app.add_typer(alert_app, name="alert")
