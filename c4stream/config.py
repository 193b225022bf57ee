"""Every table of ``c4stream.toml`` in one place, for ``c4stream config check``.

Each stage declares its own table (a :class:`~c4base.config.Section`) next to the
code that uses it; this module, at the top of the layers, only gathers them so one
command can validate a whole file with the same code the services use to read it.

>>> check_config(text="[worker]\\nbatch_max = -1", env={})[0].ok
False
>>> load_section("metrics", text="[metrics]\\nport = 9464", env={}).port
9464
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from c4base import config as base
from c4base.settings_loader import load_raw
from producers.exporter.core import EXPORTER_SECTION
from sinks.actuator.config import ACTUATOR_SECTION
from sinks.alert.config import ALERT_SECTION
from sinks.archive.consumer import ARCHIVE_SECTION
from streams.app.settings import WORKER_SECTION

__all__ = ["SECTIONS", "SectionReport", "check_config", "load_section"]

SECTIONS: dict[str, base.Section] = {
    "kafka": base.KAFKA_SECTION,
    "metrics": base.METRICS_SECTION,
    "log": base.LOG_SECTION,
    "worker": WORKER_SECTION,
    "exporter": EXPORTER_SECTION,
    "actuator": ACTUATOR_SECTION,
    "archive": ARCHIVE_SECTION,
    "alert": ALERT_SECTION,
}
"""Table name → how it is read, for every table the file may hold."""


def load_section(name: str, path: str | Path | None = None, **kwargs: Any) -> Any:
    """:func:`c4base.config.load_section` for a table known by name."""
    return base.load_section(name, SECTIONS[name], path, **kwargs)


@dataclass(frozen=True, slots=True)
class SectionReport:
    section: str
    ok: bool
    message: str


def check_config(
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[SectionReport]:
    """Validate every table; unknown tables are errors too (a typo must not pass)."""
    env = os.environ if env is None else env
    doc, source = load_raw(path, text=text, env=env)
    out: list[SectionReport] = []
    for name in doc:
        if name not in SECTIONS:
            out.append(
                SectionReport(name, False, f"unknown table [{name}]; known: {', '.join(SECTIONS)}")
            )
    for name, section in SECTIONS.items():
        if name not in doc:
            continue
        if not isinstance(doc[name], Mapping):
            out.append(SectionReport(name, False, f"{source}: {name} must be a [{name}] table"))
            continue
        try:
            section.build(base.section_data(doc, name, section.cls), env)
            out.append(SectionReport(name, True, "ok"))
        except (msgspec.ValidationError, ValueError) as err:
            out.append(SectionReport(name, False, f"{source}: {base.describe_error(name, err)}"))
    return out
