"""docs/limits.md agrees with the code: every row's ``code`` reference is looked up and
its value compared with the documented default, and every limit listed here is in the
table (a new limit, or a changed default, fails until the doc says so)."""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "limits.md"

#: Every limit docs/limits.md must list (the test fails if one is missing).
REQUIRED = {
    "producers.guard:MAX_MESSAGE_BYTES",
    "producers.guard:MAX_DEPTH",
    "producers.guard:HOST_PATTERN",
    "producers.events:NRANKS_CEILING",
    "producers.events:I64_MAX",
    "producers.events:NonNegFloat#le",
    "producers.events:NonEmpty#max_length",
    "producers.events:Short#max_length",
    "streams.app.settings:WorkerConfig.max_message_bytes",
    "streams.app.settings:WorkerConfig.max_nranks",
    "streams.app.settings:WorkerConfig.max_future_skew_s",
    "streams.app.settings:WorkerConfig.max_past_skew_s",
    "streams.app.settings:WorkerConfig.fetch_max_partition_bytes",
    "streams.app.settings:WorkerConfig.max_checkpoint_chunk_bytes",
    "streams.app.checkpoint:MAX_CHECKPOINT_BYTES",
    "streams.app.agents:MAX_RECORD_BYTES",
    "streams.commands:MAX_COMMAND_BYTES",
    "streams.commands:_Str#max_length",
    "streams.commands:_Id#max_length",
    "streams.commands:IsolationCommand.gpu#le",
    "streams.verdicts:MAX_VERDICT_BYTES",
    "sinks.actuator.config:ActuatorConfig.max_actions_per_job_per_hour",
    "sinks.actuator.config:ActuatorConfig.fault_window_s",
    "sinks.actuator.config:RestartSettings.max_per_hour",
    "producers.exporter.core:ExporterConfig.max_batch_bytes",
    "producers.exporter.core:ExporterConfig.max_batch_events",
    "producers.exporter.core:ExporterConfig.max_bytes_per_file",
    "c4base.deadletter:MAX_PAYLOAD",
    "c4base.deadletter:MAX_REASON",
    "c4base.deadletter:MAX_KEY",
    "producers.columnar:MAX_DECODED_BYTES",
    "streams.app.settings:WorkerConfig.dedup_messages",
    "streams.app.detect_runner:EdgeLimits.exec_free_us",
    "streams.app.settings:WorkerConfig.replay_window_s",
    "streams.app.trust:MAX_SEQS_PER_HOST",
    "streams.app.settings:WorkerConfig.contested_hold_s",
    "streams.app.settings:WorkerConfig.max_isolations_per_hour",
    "streams.app.settings:WorkerConfig.max_comms",
    "streams.app.settings:WorkerConfig.max_lanes",
    "streams.app.settings:WorkerConfig.evict_idle_s",
    "streams.core.stats:CLIP_X",
}

_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def rows() -> list[dict[str, str]]:
    """The table's rows as {column: cell}."""
    lines = [ln for ln in DOC.read_text().splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=True))
            for ln in lines[2:]]  # fmt: skip


def documented(cell: str) -> float:
    """The first value of a ``default`` cell: ``8 MiB``, ``2^20``, ``0 … 2^63-1``,
    ``65,536``, ``1e15``, ``600 s``, ``≤ 4096 characters``, ``1 … 256 characters``.

    >>> [documented(c) for c in ("8 MiB", "2^20", "0 … 2^63-1", "65,536", "≤ 2^16", "1e15")]
    [8388608, 1048576, 9223372036854775807, 65536, 65536, 1000000000000000.0]
    """
    text = cell.split("(")[0].replace(",", "")
    text = text.split("…")[-1]  # a range: its upper end
    m = re.search(r"2\^(\d+)(-1)?|(\d+(?:\.\d+)?(?:e\d+)?)\s*(KiB|MiB|GiB)?", text)
    if m is None:
        raise ValueError(f"no value in {cell!r}")
    if m.group(1):
        return (1 << int(m.group(1))) - (1 if m.group(2) else 0)
    value = float(m.group(3))
    value *= _UNITS.get(m.group(4) or "", 1)
    return int(value) if value.is_integer() and "e" not in m.group(3) else value


def _meta(tp: Any, key: str) -> Any:
    """``key`` of the msgspec.Meta inside ``tp`` (an Annotated alias, maybe | None)."""
    for arg in (tp, *typing.get_args(tp)):
        for meta in getattr(arg, "__metadata__", ()):
            if isinstance(meta, msgspec.Meta) and getattr(meta, key) is not None:
                return getattr(meta, key)
    raise LookupError(f"no msgspec.Meta({key}=...) in {tp!r}")


def _field(cls: type, name: str) -> Any:
    """Default (or, with ``#key``, the annotation) of ``cls.name``."""
    if issubclass(cls, msgspec.Struct):
        (f,) = [f for f in msgspec.structs.fields(cls) if f.name == name]
        return f
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f


def resolve(ref: str) -> Any:
    """``module:NAME``, ``module:Class.field`` (its default) or ``…#key`` (a msgspec.Meta
    bound of the name or field's type)."""
    ref, _, key = ref.partition("#")
    module, _, path = ref.partition(":")
    obj: Any = importlib.import_module(module)
    name, _, field = path.partition(".")
    obj = getattr(obj, name)
    if field:
        f = _field(obj, field)
        if key:
            hints = typing.get_type_hints(obj, include_extras=True)
            return _meta(hints[field], key)
        return f.default
    return _meta(obj, key) if key else obj


def test_every_limit_is_documented() -> None:
    refs = {r["code"].strip("`") for r in rows() if r["code"]}
    assert REQUIRED - refs == set(), "limits missing from docs/limits.md"


@pytest.mark.parametrize("row", [r for r in rows() if r["code"]], ids=lambda r: r["code"])
def test_documented_default_matches_the_code(row: dict[str, str]) -> None:
    value = resolve(row["code"].strip("`"))
    if isinstance(value, str):  # a pattern: the numbers the doc names are in it
        for number in re.findall(r"\d+", row["default"].split("(")[0]):
            assert number in value, (row["code"], number)
        return
    assert documented(row["default"]) == value, (row["code"], row["default"], value)


def test_settings_named_in_the_doc_are_the_fields_with_that_default() -> None:
    """``[section] name`` in the setting column is the field the code reference reads."""
    for r in rows():
        m = re.fullmatch(r"`\[([\w.]+)\] (\w+)`", r["setting"])
        if m and r["code"]:
            assert r["code"].strip("`").split(".")[-1].split("#")[0] == m.group(2), r
