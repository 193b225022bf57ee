"""Load one typed settings object from a TOML file plus environment overrides.

Overrides use ``C4STREAM__SECTION__KEY=value`` (double underscores separate levels);
the value is read as a TOML value when it parses as one (``5``, ``true``, ``["a"]``)
and as a plain string otherwise. Errors name the setting and where it came from.

>>> from c4base.kafka import KafkaConfig
>>> load_settings(KafkaConfig, text='topic_prefix = "t."', env={"C4STREAM__BOOTSTRAP": "k:1"})
KafkaConfig(bootstrap='k:1', topic_prefix='t.', extra={})
>>> load_settings(KafkaConfig, text='topic_prefix = 5', env={})
Traceback (most recent call last):
...
c4base.settings_loader.SettingsError: <text>: Expected `str`, got `int` - at `$.topic_prefix`
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

__all__ = ["ENV_PREFIX", "SettingsError", "env_overrides", "load_raw", "load_settings"]

ENV_PREFIX = "C4STREAM__"
T = TypeVar("T")


class SettingsError(ValueError):
    """The configuration is invalid; the message names the setting and its source."""


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"x = {raw}")["x"]
    except tomllib.TOMLDecodeError:
        return raw


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict of the ``C4STREAM__A__B=v`` variables in ``env``."""
    out: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not path:
            continue
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SettingsError(f"{name}: conflicts with another override")
        node[path[-1]] = _parse_value(raw)
    return out


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def load_raw(
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], str]:
    """The TOML document with environment overrides merged in, and a name for errors."""
    source = str(path) if path is not None else "<text>"
    data: dict[str, Any] = {}
    try:
        if path is not None:
            data = tomllib.loads(Path(path).read_text())
        elif text is not None:
            data = tomllib.loads(text)
    except FileNotFoundError:
        raise SettingsError(f"{source}: no such configuration file") from None
    except tomllib.TOMLDecodeError as err:
        raise SettingsError(f"{source}: not valid TOML: {err}") from None
    overrides = env_overrides(os.environ if env is None else env)
    if overrides:
        _merge(data, overrides)
        source += " + environment"
    return data, source


def load_settings(
    cls: type[T],
    path: str | Path | None = None,
    *,
    text: str | None = None,
    env: Mapping[str, str] | None = None,
) -> T:
    """Read ``cls`` from a TOML file (or ``text``), then apply environment overrides."""
    data, source = load_raw(path, text=text, env=env)
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as err:
        raise SettingsError(f"{source}: {err}") from None
