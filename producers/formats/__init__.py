"""Readers that turn real tools' output into contract events.

* :mod:`producers.formats.inspector` — NCCL Inspector plugin dumps (JSON lines).
* :mod:`producers.formats.flight_recorder` — PyTorch NCCL Flight Recorder dumps
  (pickle or JSON), read with a restricted unpickler.

Each reader maps one unit of input (a line, a dump file) to events or raises its
format's error type with a reason an operator can act on; the caller reports it as bad
input (``file:line: reason``) and goes on. docs/inputs.md documents every
field mapping and what each format cannot tell.
"""

from __future__ import annotations

from producers.formats.flight_recorder import FlightRecorderError, read_flight_recorder
from producers.formats.inspector import InspectorError, parse_inspector_line, read_inspector_file

__all__ = [
    "FlightRecorderError",
    "InspectorError",
    "parse_inspector_line",
    "read_flight_recorder",
    "read_inspector_file",
]
