"""Chat targets, one module each, all behind :class:`~sinks.alert.targets.base.Target`.

>>> sorted(TARGETS)  # doctest: +NORMALIZE_WHITESPACE
['alertmanager_api', 'alertmanager_webhook', 'dingtalk', 'discord', 'feishu', 'mattermost',
 'slack', 'teams']

``type = "alertmanager"`` (the name before there was an Alertmanager API client) still
selects the webhook-format target: see :data:`ALIASES`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sinks.alert.config import Destination
from sinks.alert.targets import (  # noqa: F401  (importing registers each target)
    alertmanager_api,
    alertmanager_webhook,
    dingtalk,
    discord,
    feishu,
    mattermost,
    slack,
    teams,
)
from sinks.alert.targets.base import TARGETS, Outcome, Target, WebhookRequest

__all__ = ["ALIASES", "TARGETS", "Outcome", "Target", "WebhookRequest", "make_target"]

#: Old config type names and the target they select.
ALIASES = {"alertmanager": "alertmanager_webhook"}


def make_target(
    destination: Destination, *, external_url: str = "", clock: Callable[[], float] = time.time
) -> Target:
    """The target for one configured destination."""
    kind = ALIASES.get(destination.type, destination.type)
    return TARGETS[kind](destination, external_url=external_url, clock=clock)
