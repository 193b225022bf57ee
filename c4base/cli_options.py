"""The options every service command shares, declared once, and its one error style.

Each option is an ``Annotated`` type whose metadata carries the dotted config key it
overrides (:class:`Key`), so a command needs no hand-written table from parameter to
key: :func:`given` reads the keys off the command's own signature and returns only
the options the user typed (a default never hides the file's value). Every default is
``None`` or the config's own default, the same in every command.

>>> import typing
>>> [m.key for m in typing.get_args(Bootstrap)[1:] if isinstance(m, Key)]
['kafka.bootstrap']
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

__all__ = [
    "Bootstrap",
    "BrokerTimeout",
    "config_file",
    "Group",
    "InstanceId",
    "Key",
    "LogJson",
    "LogLevel",
    "MetricsHost",
    "MetricsPort",
    "StatusFile",
    "TopicPrefix",
    "fail",
    "given",
]


class Key:
    """Metadata of an option: the dotted key of the service's config it overrides."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"Key({self.key!r})"


def config_file(tables: str) -> Any:
    """The ``--config`` option of a command that reads ``tables`` (e.g. "[kafka], [worker]").

    Help texts name the tables, so each command makes its own (at module level, where
    Typer and :func:`given` resolve annotations)."""
    return Annotated[
        Path | None,
        typer.Option(
            "--config",
            "-c",
            help=f"c4stream.toml: {tables}, [metrics], [log]; flags win over the file.",
        ),
    ]


Bootstrap = Annotated[
    str | None,
    typer.Option(
        "--bootstrap",
        "-b",
        help="Kafka host:port[,host:port] (default: [kafka] bootstrap, else "
        "127.0.0.1:9092); KAFKA_BOOTSTRAP overrides.",
    ),
    Key("kafka.bootstrap"),
]
TopicPrefix = Annotated[
    str | None,
    typer.Option("--topic-prefix", help="Prefix of the c4.* topic names."),
    Key("kafka.topic_prefix"),
]
Group = Annotated[
    str | None,
    typer.Option("--group", help="Kafka consumer group (default: the service's own)."),
    Key("group"),
]
InstanceId = Annotated[
    str | None,
    typer.Option(
        "--instance-id",
        help="Static group member id (default: GROUP@hostname, a pod's name in Kubernetes): "
        "a restarted member takes its partitions back at once. Empty: dynamic membership.",
    ),
    Key("instance_id"),
]
BrokerTimeout = Annotated[
    float | None,
    typer.Option(
        "--broker-timeout",
        help="Exit non-zero when the broker stays unreachable this many seconds "
        "(default 120; 0: never).",
    ),
    Key("broker_timeout_s"),
]
StatusFile = Annotated[
    Path | None,
    typer.Option("--status-file", help="Write the service's status JSON here every second."),
    Key("status_file"),
]
MetricsPort = Annotated[
    int | None,
    typer.Option(
        "--metrics-port", help="Serve Prometheus /metrics on this port (0: off; default: off)."
    ),
]
MetricsHost = Annotated[
    str | None,
    typer.Option(
        "--metrics-host", help="Address of /metrics: 127.0.0.1 unless inside a pod (0.0.0.0)."
    ),
]
LogLevel = Annotated[
    str | None, typer.Option("--log-level", help="DEBUG, INFO (default), WARNING, ERROR.")
]
LogJson = Annotated[
    bool,
    typer.Option(
        "--log-json", help="One JSON object per log line (for log shippers); default plain text."
    ),
]


def _keys(command: Callable[..., Any]) -> dict[str, str]:
    hints = typing.get_type_hints(command, include_extras=True)
    out = {}
    for name in inspect.signature(command).parameters:
        for meta in getattr(hints.get(name), "__metadata__", ()):
            if isinstance(meta, Key):
                out[name] = meta.key
    return out


def given(
    ctx: Any, command: Callable[..., Any], *, prefix: str = "", **values: Any
) -> dict[str, Any]:
    """Config overrides of the options the user typed: ``{dotted key: value}``.

    ``prefix`` keeps only keys under it, without it (``"kafka."`` for a ``[kafka]``
    table loaded on its own); ``values`` replaces a parameter's raw value.
    """
    # here, not at module top: every command module imports these options, and the
    # config pulls in the Kafka and Prometheus clients that `c4stream --help` never needs
    from c4base.config import flag_overrides

    keys = _keys(command)
    if prefix:
        keys = {p: k.removeprefix(prefix) for p, k in keys.items() if k.startswith(prefix)}
    return flag_overrides(ctx, keys, **values)


def fail(command: str, err: object, code: int = 1) -> NoReturn:
    """The one error style: ``c4stream COMMAND: error: MESSAGE`` on stderr, unwrapped
    (a log reader greps it), then exit ``code`` (2: usage or configuration)."""
    typer.echo(f"c4stream {command}: error: {err}", err=True)
    raise typer.Exit(code)


def option_keys(command: Callable[..., Any]) -> Mapping[str, str]:
    """Parameter name → config key of ``command``'s options (for docs and tests)."""
    return _keys(command)
