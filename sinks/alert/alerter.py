"""The alerter without Kafka: grouping -> routing -> delivery, driven by plain calls.

The Kafka consumer and ``c4stream alert test`` both drive this object, and so do tests.

>>> import asyncio
>>> from sinks.alert.config import AlertConfig, Destination
>>> cfg = AlertConfig(destination=[Destination(type="slack", url="http://127.0.0.1:9/x")])
>>> async def demo():
...     async with Alerter.from_config(cfg, clock=lambda: 0.0) as a:
...         return a.grouper.stats.opened
>>> asyncio.run(demo())
0
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import httpx

from sinks.actuator.outcomes import ActionReport
from sinks.alert.config import AlertConfig
from sinks.alert.delivery import Delivery, Done
from sinks.alert.grouping import Grouper, Observation
from sinks.alert.model import Notification
from sinks.alert.routing import Router
from sinks.alert.targets import make_target
from streams.commands import IsolationCommand
from streams.verdicts import Verdict

__all__ = ["Alerter"]

log = logging.getLogger(__name__)


class Alerter:
    def __init__(
        self,
        grouper: Grouper,
        router: Router,
        delivery: Delivery,
        *,
        include_verdicts: bool = True,
        include_bookkeeping: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.grouper = grouper
        self.router = router
        self.delivery = delivery
        self.include_verdicts = include_verdicts
        self.include_bookkeeping = include_bookkeeping
        self.clock = clock
        self._started = clock()
        self._refreshed: dict[str, float] = {}
        """Per refreshing target: when open alerts were last re-posted."""

    @classmethod
    def from_config(
        cls,
        cfg: AlertConfig,
        *,
        client: httpx.AsyncClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> Alerter:
        targets = [
            make_target(d, external_url=cfg.external_url, clock=clock) for d in cfg.destination
        ]
        delivery = Delivery(
            targets,
            queue_size=cfg.queue_size,
            max_attempts=cfg.max_attempts,
            retry_for_s=cfg.retry_for_s,
            backoff_base_s=cfg.backoff_base_s,
            backoff_max_s=cfg.backoff_max_s,
            retry_after_max_s=cfg.retry_after_max_s,
            timeout_s=cfg.timeout_s,
            client=client,
        )
        grouper = Grouper(
            resolve_timeout_s=cfg.resolve_timeout_s,
            repeat_interval_s=cfg.repeat_interval_s,
            max_groups=cfg.max_groups,
        )
        return cls(
            grouper,
            Router(cfg.destination),
            delivery,
            include_verdicts=cfg.include_verdicts,
            include_bookkeeping=cfg.include_bookkeeping,
            clock=clock,
        )

    async def __aenter__(self) -> Alerter:
        self.delivery.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.delivery.aclose()

    def routes(self, notifications: list[Notification]) -> list[tuple[str, Notification]]:
        """(destination, notification) pairs to send."""
        return [(name, n) for n in notifications for name in self.router.route(n)]

    def dispatch(
        self, notifications: list[Notification], done: Callable[[], Done] | None = None
    ) -> int:
        """Queue each notification for its destinations; returns how many were queued.
        ``done`` makes one completion callback per queued copy."""
        pairs = self.routes(notifications)
        for name, n in pairs:
            if done is None:
                self.delivery.offer(name, n)
            else:
                self.delivery.offer(name, n, done())
        return len(pairs)

    def on_command(self, cmd: IsolationCommand) -> int:
        return self.dispatch(self.command_notifications(cmd))

    def on_verdict(self, v: Verdict) -> int:
        return self.dispatch(self.verdict_notifications(v))

    def command_notifications(self, cmd: IsolationCommand) -> list[Notification]:
        return self.grouper.observe(Observation.of_command(cmd), self.clock())

    def verdict_notifications(self, v: Verdict) -> list[Notification]:
        if not self.include_verdicts:
            return []
        if v.benign and v.score <= 0 and not self.include_bookkeeping:
            return []  # bookkeeping (a host census for the correlator), not news
        return self.grouper.observe(Observation.of_verdict(v), self.clock())

    def on_action(self, r: ActionReport) -> int:
        """What the actuator did (``c4.actions``): shown on the host's open alert."""
        return self.dispatch(self.action_notifications(r))

    def action_notifications(self, r: ActionReport) -> list[Notification]:
        return self.grouper.observe_outcome(
            r.job, r.host, r.outcome, r.detail, r.dry_run, self.clock()
        )

    def tick(self) -> int:
        """Resolve quiet alerts, refresh open ones where a target needs it; ~once a second."""
        pairs = self.tick_routes()
        for name, n in pairs:
            self.delivery.offer(name, n)
        return len(pairs)

    def tick_routes(self) -> list[tuple[str, Notification]]:
        """What :meth:`tick` sends, without sending it (the Kafka side queues it from
        another thread)."""
        now = self.clock()
        pairs = self.routes(self.grouper.expire(now))
        for name, target in self.delivery.targets.items():
            if not target.refreshes:
                continue
            last = self._refreshed.setdefault(name, self._started)
            if now - last < target.destination.refresh_interval_s:
                continue
            self._refreshed[name] = now
            pairs += [(name, n) for n in self.grouper.open_alerts() if name in self.router.route(n)]
        return pairs

    def send_to_all(self, n: Notification) -> int:
        """Queue ``n`` for every destination regardless of severity (``alert test``)."""
        for name in self.delivery.targets:
            self.delivery.offer(name, n)
        return len(self.delivery.targets)
