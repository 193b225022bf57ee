"""The alerter's typed configuration, read from a TOML file of destinations.

Example ``alert.toml``::

    resolve_timeout_s = 600          # quiet period after which a host's alert resolves
    external_url = "https://grafana.example.org/d/c4stream"

    [[destination]]
    type = "slack"                   # slack mattermost teams dingtalk feishu discord
                                     # alertmanager_api alertmanager_webhook
    url_env = "C4_SLACK_URL"         # or url = "https://hooks.slack.com/services/..."
    min_severity = "warning"         # info | warning | critical

    [[destination]]
    type = "dingtalk"
    url = "https://oapi.dingtalk.com/robot/send?access_token=..."
    secret_env = "C4_DINGTALK_SECRET"
    min_severity = "critical"

Webhook URLs are credentials too (Slack, Discord, Feishu and Mattermost put the token in
the path), so both ``url`` and ``secret`` are redacted in ``repr`` and in every log line:
only scheme and host are ever shown.

>>> d = Destination(type="feishu", url="https://open.feishu.cn/open-apis/bot/v2/hook/tok",
...                 secret="s3cr3t")
>>> "tok" in repr(d) or "s3cr3t" in repr(d)
False
>>> d.redacted_url
'https://open.feishu.cn/…'
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec

from c4base.config import Section
from sinks.alert.model import Severity
from sinks.alert.sent import DEFAULT_SENT_LEDGER

__all__ = [
    "AlertConfig",
    "ConfigError",
    "Destination",
    "TargetType",
    "config_from_table",
    "load_config",
    "redact_url",
]

TargetType = Literal[
    "slack",
    "mattermost",
    "teams",
    "dingtalk",
    "feishu",
    "discord",
    "alertmanager_api",
    "alertmanager_webhook",
    "alertmanager",  # old name of alertmanager_webhook, kept so old files still load
]


class ConfigError(ValueError):
    """The alert config is unusable; the message names the file, the entry and the fix."""


def redact_url(url: str) -> str:
    """Scheme and host only: paths and queries of webhook URLs carry tokens.

    >>> redact_url("https://user:pw@hooks.slack.com/services/T0/B0/XYZ?x=1")
    'https://hooks.slack.com/…'
    """
    parts = urlsplit(url)
    host = parts.hostname or "?"
    if parts.port:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}/…"


class Destination(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One chat webhook and the least severity it wants to hear about."""

    type: TargetType
    url: str
    secret: str | None = None
    """Signing secret (DingTalk, Feishu); ignored by the other targets."""
    min_severity: Severity = "warning"
    name: str = ""
    """Shown in logs and as Alertmanager's ``receiver``; defaults to ``<type>-<index>``."""
    send_resolved: bool = True
    refresh_interval_s: float = 60.0
    """``alertmanager_api`` only: re-post open alerts this often (their ``endsAt`` is
    4 intervals ahead, so Alertmanager keeps them while c4stream runs)."""
    max_in_flight: int = 8
    """Requests to this destination at once (alerts of different hosts; one host's
    stay in order). A receiver answering after T seconds then delays the n-th alert of
    a burst by about ceil(n / max_in_flight) * T, not n * T. Lower it for chats with
    strict per-bot rate limits."""
    retry_unconfirmed: bool = False
    """Re-post a request whose answer never came (read timeout, connection closed after
    the request was sent). Off: it is logged as "maybe delivered" and not repeated,
    since the receiver may have posted it (a chat shows it twice). Targets that
    deduplicate (``alertmanager_api``) are always retried."""

    @property
    def redacted_url(self) -> str:
        return redact_url(self.url)

    def __repr__(self) -> str:
        secret = "'***'" if self.secret else "None"
        return (
            f"Destination(name={self.name!r}, type={self.type!r}, url={self.redacted_url!r}, "
            f"secret={secret}, min_severity={self.min_severity!r}, "
            f"send_resolved={self.send_resolved!r})"
        )

    __str__ = __repr__


class AlertConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything the alerter needs besides Kafka; passed explicitly to each part."""

    destination: list[Destination]
    resolve_timeout_s: float = 600.0
    """A host's alert resolves when no command or verdict for it arrived for this long."""
    repeat_interval_s: float = 4 * 3600.0
    """Remind about a still-open alert this often (0 = never)."""
    max_groups: int = 10_000
    """Open alerts kept at most; beyond that the least recently seen is forgotten."""
    include_verdicts: bool = True
    """Alert on verdicts too (``info``/``warning``), not only on isolation commands."""
    include_bookkeeping: bool = False
    """Also alert on bookkeeping verdicts (benign, score 0: e.g. a communicator's host
    census, "tp-node-000 spans 1 hosts."), which the detectors emit for the correlator."""
    external_url: str = ""
    """Link put in every message (dashboard, runbook) and Alertmanager's ``externalURL``."""
    queue_size: int = 1000
    """Pending notifications per destination; when full the oldest lowest-severity is dropped."""
    retry_for_s: float = 600.0
    """Retry a notification this long after it was queued (then it is dead-lettered)."""
    max_attempts: int = 0
    """At most this many tries per notification (0: no limit besides ``retry_for_s``)."""
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    retry_after_max_s: float = 300.0
    """Cap on a server's Retry-After, so one bad header cannot park a destination for days."""
    timeout_s: float = 10.0
    group: str = "c4stream-alert"
    """Kafka consumer group."""
    instance_id: str | None = None
    """Static group membership (default ``group@hostname``; "" for dynamic)."""
    from_beginning: bool = False
    """A new consumer group reads the topics from the start (default: from the end)."""
    broker_timeout_s: float = 120.0
    """Exit non-zero when the broker stays unreachable this long (0: never)."""
    status_file: str = ""
    """Write the alerter's status JSON here every second ("": no file)."""
    sent_ledger: str = DEFAULT_SENT_LEDGER
    """SQLite file recording each post before and after it, so that a message read again
    after a kill is not posted twice (:mod:`sinks.alert.sent`; "": off)."""

    def __post_init__(self) -> None:
        if not self.destination:
            raise ConfigError("no [[destination]] configured: add at least one")
        seen: set[str] = set()
        for i, d in enumerate(self.destination):
            if not d.name:
                d.name = f"{d.type}-{i}"
            if d.name in seen:
                raise ConfigError(f"destination name {d.name!r} is used twice: make names unique")
            seen.add(d.name)
            if urlsplit(d.url).scheme not in ("http", "https"):
                raise ConfigError(
                    f"destination {d.name!r}: url must start with http:// or https:// "
                    f"(got {d.redacted_url})"
                )
        if self.queue_size < 1 or self.max_attempts < 0 or self.retry_for_s < 0:
            raise ConfigError(
                "queue_size must be at least 1, max_attempts and retry_for_s at least 0"
            )
        if self.resolve_timeout_s <= 0:
            raise ConfigError("resolve_timeout_s must be positive")
        for d in self.destination:
            if d.refresh_interval_s <= 0:
                raise ConfigError(f"destination {d.name!r}: refresh_interval_s must be positive")
            if d.max_in_flight < 1:
                raise ConfigError(f"destination {d.name!r}: max_in_flight must be at least 1")

    def warnings(self) -> list[str]:
        """Settings that work but are probably not what was meant (``config check``)."""
        out = []
        for d in self.destination:
            if d.type == "alertmanager":
                out.append(
                    f"destination {d.name!r}: type 'alertmanager' is the old name of "
                    "'alertmanager_webhook' (the payload Alertmanager sends to webhook "
                    "receivers); to feed an Alertmanager use type 'alertmanager_api'"
                )
        return out

    def __repr__(self) -> str:
        dests = ", ".join(repr(d) for d in self.destination)
        return f"AlertConfig(destination=[{dests}], resolve_timeout_s={self.resolve_timeout_s})"

    __str__ = __repr__


def _resolve_env(entry: dict[str, Any], env: Mapping[str, str], where: str) -> dict[str, Any]:
    out = dict(entry)
    for field in ("url", "secret"):
        name = out.pop(f"{field}_env", None)
        if name is None:
            continue
        if field in out:
            raise ConfigError(f"{where}: set either {field} or {field}_env, not both")
        if name not in env:
            raise ConfigError(f"{where}: environment variable {name} ({field}_env) is not set")
        out[field] = env[name]
    return out


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> AlertConfig:
    """Read ``alert.toml``; ``url_env``/``secret_env`` name variables looked up in ``env``.

    The caller passes ``env`` (the CLI passes ``os.environ``): nothing below reads the
    environment by itself.
    """
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such alert config file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    return config_from_table(raw, env or {}, str(path))


def config_from_table(
    raw: Mapping[str, Any], env: Mapping[str, str], where: str = "alert config"
) -> AlertConfig:
    """The alerter's settings from a parsed table: a whole ``alert.toml`` (top-level
    ``[[destination]]``) or the ``[alert]`` table of ``c4stream.toml``
    (``[[alert.destination]]``); ``where`` names it in errors.

    >>> cfg = config_from_table({"destination": [{"type": "slack", "url_env": "U"}]},
    ...                         {"U": "https://hooks.slack.com/x"}, "[alert]")
    >>> cfg.destination[0].name
    'slack-0'
    """
    raw = dict(raw)
    dests = raw.get("destination")
    if not isinstance(dests, list):
        raise ConfigError(f"{where}: add at least one [[destination]] table")
    raw["destination"] = [
        _resolve_env(d, env, f"{where}: destination #{i + 1}") for i, d in enumerate(dests)
    ]
    try:
        return msgspec.convert(raw, AlertConfig)
    except msgspec.ValidationError as err:
        # msgspec's message names the field path but never echoes values (no secret leaks).
        raise ConfigError(f"{where}: {err}") from None


ALERT_SECTION = Section(AlertConfig, lambda data, env: config_from_table(data, env, "[alert]"))
"""``[alert]`` of ``c4stream.toml`` (``url_env`` resolved from the environment)."""
