"""Chat targets, one module each, all behind :class:`~sinks.alert.targets.base.Target`.

>>> sorted(TARGETS)
['alertmanager', 'dingtalk', 'discord', 'feishu', 'mattermost', 'slack', 'teams']
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sinks.alert.config import Destination
from sinks.alert.targets import (  # noqa: F401  (importing registers each target)
    alertmanager,
    dingtalk,
    discord,
    feishu,
    mattermost,
    slack,
    teams,
)
from sinks.alert.targets.base import TARGETS, Outcome, Target, WebhookRequest

__all__ = ["TARGETS", "Outcome", "Target", "WebhookRequest", "make_target"]


def make_target(
    destination: Destination, *, external_url: str = "", clock: Callable[[], float] = time.time
) -> Target:
    """The target for one configured destination."""
    return TARGETS[destination.type](destination, external_url=external_url, clock=clock)
