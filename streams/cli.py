"""Command-line commands of the streams stage; registered on the main app by :mod:`c4stream.cli`.

Heavy imports stay inside the command functions so that `c4stream --help` is fast.
"""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this stage's commands to the main ``c4stream`` app."""
