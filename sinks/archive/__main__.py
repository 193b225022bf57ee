"""``python -m sinks.archive [OPTIONS] [dedupe DIR]``: the ``c4stream archive`` command alone."""

from sinks.archive.cli import app

app(prog_name="c4stream archive")
