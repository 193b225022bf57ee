"""Loading one table of ``c4stream.toml`` into the typed object its service uses.

``[kafka]`` is shared (bootstrap, topic prefix, SASL/TLS properties under
``[kafka.extra]``); each service reads its own table (``[worker]``, ``[exporter]``,
``[actuator]``, ``[archive]``, ``[alert]``) and the common ``[metrics]`` and ``[log]``.
Each stage declares its own table as a :class:`Section` and passes it here; this module
knows none of them (``c4stream.config`` gathers them all for ``c4stream config check``).
Environment variables ``C4STREAM__SECTION__KEY=value`` override the file, and
``KAFKA_BOOTSTRAP`` overrides the bootstrap servers.

Precedence, lowest first: defaults < file < ``C4STREAM__…`` environment < command-line
flags (``overrides``, dotted keys); ``KAFKA_BOOTSTRAP`` wins over any bootstrap.

>>> cfg = load_section("metrics", METRICS_SECTION, text="[metrics]\\nport = 9464", env={})
>>> cfg.port, cfg.host
(9464, '127.0.0.1')
>>> load_section("metrics", METRICS_SECTION, text="[metrics]\\nport = 9464", env={},
...              overrides={"port": 1}).port
1
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path, PurePath
from typing import Any

import msgspec
import msgspec.inspect

from c4base.kafka import KafkaConfig
from c4base.metrics import MetricsConfig
from c4base.settings_loader import SettingsError, load_raw

__all__ = [
    "KAFKA_SECTION",
    "LOG_SECTION",
    "METRICS_SECTION",
    "LogSettings",
    "Section",
    "SettingsError",
    "describe_error",
    "flag_overrides",
    "load_section",
    "section_data",
]

Converter = Callable[[dict[str, Any], Mapping[str, str]], Any]
"""``(table, environment) -> typed object``; raises ``ValueError`` (or msgspec's
``ValidationError``) with a message naming the bad setting."""


@dataclass(frozen=True, slots=True)
class LogSettings:
    level: str = "INFO"
    json: bool = False
    """One JSON object per line, for log shippers."""


def _dec_hook(typ: type, obj: Any) -> Any:
    # msgspec has no Path type: the exporter's dataclass uses Path fields.
    if isinstance(typ, type) and issubclass(typ, PurePath) and isinstance(obj, str):
        return typ(obj)
    raise NotImplementedError(f"{typ} is not a supported setting type")


@dataclass(frozen=True, slots=True)
class Section:
    """How one table becomes the typed object its service uses.

    ``convert`` is for services whose loader does more than a type check (the alerter
    resolves ``url_env`` from the environment); by default the table is converted to
    ``cls`` with msgspec.
    """

    cls: type
    convert: Converter | None = None

    def build(self, data: dict[str, Any], env: Mapping[str, str]) -> Any:
        if self.convert is not None:
            return self.convert(data, env)
        # msgspec ignores unknown keys of dataclasses and names no alternatives for
        # structs: a typo must not pass, and the message says what was meant.
        check_unknown(data, msgspec.inspect.type_info(self.cls))
        return msgspec.convert(data, self.cls, dec_hook=_dec_hook)


def check_unknown(data: Any, info: msgspec.inspect.Type, table: str = "") -> None:
    """Raise ``ValueError`` naming unknown keys of ``data`` (and of its sub-tables).

    >>> check_unknown({"port": 1, "hots": "x"}, msgspec.inspect.type_info(MetricsConfig))
    Traceback (most recent call last):
    ...
    ValueError: unknown setting(s) hots; known: host, port
    """
    if not isinstance(data, Mapping) or not isinstance(
        info, msgspec.inspect.StructType | msgspec.inspect.DataclassType
    ):
        return
    known = {f.encode_name: f for f in info.fields}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"[{table}] " if table else ""
        raise ValueError(
            f"{where}unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    for key, value in data.items():
        sub = known[key].type
        if isinstance(sub, msgspec.inspect.UnionType):  # e.g. ``X | None``
            sub = next((t for t in sub.types if not isinstance(t, msgspec.inspect.NoneType)), sub)
        check_unknown(value, sub, f"{table}.{key}" if table else key)


KAFKA_SECTION = Section(KafkaConfig)
METRICS_SECTION = Section(MetricsConfig)
LOG_SECTION = Section(LogSettings)


def _has_kafka_field(cls: type) -> bool:
    if is_dataclass(cls):
        return any(f.name == "kafka" for f in fields(cls))
    return "kafka" in getattr(cls, "__struct_fields__", ())


def section_data(doc: Mapping[str, Any], name: str, cls: type) -> dict[str, Any]:
    data = dict(doc.get(name, {}))
    # The shared [kafka] table fills a service's own kafka settings unless it has some.
    if name != "kafka" and _has_kafka_field(cls) and "kafka" not in data and "kafka" in doc:
        data["kafka"] = dict(doc["kafka"])
    return data


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for part in parents:
        child = node.get(part)
        node[part] = child = dict(child) if isinstance(child, Mapping) else {}
        node = child
    node[last] = value


def load_section(
    name: str,
    section: Section | type,
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """The typed settings of one service from the file (defaults where it is silent).

    ``overrides`` are dotted keys (``"kafka.bootstrap"``, ``"group"``) from command-line
    flags; they win over the file and the environment. Raises :class:`SettingsError`.
    """
    env = os.environ if env is None else env
    section = section if isinstance(section, Section) else Section(section)
    doc, source = load_raw(path, text=text, env=env)
    if not isinstance(doc.get(name, {}), Mapping):
        raise SettingsError(f"{source}: [{name}] must be a table")
    data = section_data(doc, name, section.cls)
    for key, value in (overrides or {}).items():
        _set_dotted(data, key, value)
    if overrides:
        source += " + command line"
    try:
        return section.build(data, env)
    except (msgspec.ValidationError, ValueError) as err:
        raise SettingsError(f"{source}: {describe_error(name, err)}") from None


_NESTED_AT = re.compile(r" - at `\$\.(\w+)\.([^`]+)`$")
_UNKNOWN_IN = re.compile(r"unknown field `\w+`( - at `\$\.(\w+)`)$")


def describe_error(name: str, err: Exception) -> str:
    """The message of a bad setting, naming the table it is in.

    >>> describe_error("worker", ValueError("Expected `int` - at `$.detect.window_us`"))
    '[worker.detect] Expected `int` - at `$.window_us`'
    """
    msg = str(err)
    if msg.startswith(f"[{name}"):
        return msg
    if msg.startswith("["):  # a sub-table named by check_unknown
        return f"[{name}.{msg[1:]}"
    nested = _NESTED_AT.search(msg)
    if nested:  # a sub-table such as [worker.detect]: name it as the user wrote it
        table, rest = nested.groups()
        return f"[{name}.{table}] {msg[: nested.start()]} - at `$.{rest}`"
    unknown = _UNKNOWN_IN.search(msg)
    if unknown:  # msgspec points at the table that holds the unknown key
        return f"[{name}.{unknown.group(2)}] {msg[: unknown.start(1)]}"
    return f"[{name}] {msg}"


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def flag_overrides(ctx: Any, keys: Mapping[str, str], **values: Any) -> dict[str, Any]:
    """Dotted config keys of the options the user actually gave (not their defaults).

    ``ctx`` is the Click/Typer context, ``keys`` maps an option's parameter name to its
    config key; ``values`` replaces a parameter's raw value (e.g. a list split on commas).
    Flags absent from the command line leave the file's value in place.
    """
    out: dict[str, Any] = {}
    for param, key in keys.items():
        # Compared by name: Typer ships its own copy of Click (typer._click), whose
        # ParameterSource is a different enum from click's.
        source = ctx.get_parameter_source(param)
        if getattr(source, "name", None) in ("COMMANDLINE", "ENVIRONMENT"):
            out[key] = _plain(values[param] if param in values else ctx.params[param])
    return out
