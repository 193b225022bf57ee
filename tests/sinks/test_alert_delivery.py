"""Delivery over real loopback HTTP: retries, Retry-After, permanent errors, never blocking."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace

import pytest

from sinks.alert.config import Destination
from sinks.alert.delivery import Delivery
from sinks.alert.samples import sample_notification
from sinks.alert.targets import make_target
from tests.sinks.test_alert_support import (
    Reply,
    WebhookServer,
    webhook_server_fixture,  # noqa: F401 (the fixture)
)


def _target(server: WebhookServer, kind: str = "slack", path: str = "/hook"):
    return make_target(Destination(type=kind, url=server.url(path), name="d"))


def _send(target, **kw) -> tuple[bool, Delivery]:
    async def go() -> tuple[bool, Delivery]:
        async with Delivery([target], **kw) as d:
            return await d.send(target, sample_notification()), d

    return asyncio.run(go())


@pytest.mark.timeout(20)
def test_503_then_200_is_retried_and_delivered(webhook_server: WebhookServer) -> None:
    webhook_server.script("/hook", Reply(503, b"upstream busy"))
    ok, d = _send(_target(webhook_server), backoff_base_s=0.05)
    assert ok
    got = webhook_server.at("/hook")
    assert len(got) == 2 and got[0].body == got[1].body
    assert (d.stats.delivered, d.stats.retries, d.stats.failed) == (1, 1, 0)


@pytest.mark.timeout(20)
def test_429_retry_after_is_honoured(webhook_server: WebhookServer) -> None:
    webhook_server.script("/hook", Reply(429, b"rate limited", {"Retry-After": "1"}))
    # Back-off alone would wait at most 10 ms: any wait near 1 s comes from Retry-After.
    ok, d = _send(_target(webhook_server), backoff_base_s=0.01, backoff_max_s=0.01)
    assert ok
    first, second = webhook_server.at("/hook")
    assert 0.9 <= second.at - first.at < 3.0
    assert d.stats.retries == 1


@pytest.mark.timeout(20)
def test_retry_after_is_capped(webhook_server: WebhookServer) -> None:
    webhook_server.script("/hook", Reply(503, b"", {"Retry-After": "86400"}))
    t0 = time.monotonic()
    ok, _ = _send(_target(webhook_server), retry_after_max_s=0.2)
    assert ok and time.monotonic() - t0 < 3.0


@pytest.mark.timeout(20)
def test_client_errors_are_not_retried(webhook_server: WebhookServer) -> None:
    webhook_server.script("/hook", Reply(404, b"no_service"))
    ok, d = _send(_target(webhook_server), backoff_base_s=0.01)
    assert not ok
    assert len(webhook_server.at("/hook")) == 1
    assert (d.stats.failed, d.stats.retries) == (1, 0)


@pytest.mark.timeout(20)
def test_vendor_error_codes_in_http_200(webhook_server: WebhookServer) -> None:
    """DingTalk answers 200 with errcode: a bad signature fails at once, a rate limit retries."""
    ding = _target(webhook_server, "dingtalk", "/ding")
    webhook_server.script("/ding", Reply(200, b'{"errcode":310000,"errmsg":"sign not match"}'))
    ok, _ = _send(ding, backoff_base_s=0.01)
    assert not ok and len(webhook_server.at("/ding")) == 1
    webhook_server.script(
        "/ding",
        Reply(200, b'{"errcode":130101,"errmsg":"send too fast"}'),
        Reply(200, b'{"errcode":0,"errmsg":"ok"}'),
    )
    ok, d = _send(ding, backoff_base_s=0.01)
    assert ok and len(webhook_server.at("/ding")) == 3 and d.stats.retries == 1


@pytest.mark.timeout(20)
def test_connection_errors_are_retried_then_given_up() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = make_target(Destination(type="slack", url=f"http://127.0.0.1:{port}/x", name="d"))
    sleeps: list[float] = []

    async def record_sleep(s: float) -> None:
        sleeps.append(s)

    async def go() -> tuple[bool, Delivery]:
        async with Delivery(
            [target],
            max_attempts=4,
            backoff_base_s=1.0,
            backoff_max_s=3.0,
            rng=lambda: 1.0,
            sleep=record_sleep,
        ) as d:
            return await d.send(target, sample_notification()), d

    ok, d = asyncio.run(go())
    assert not ok
    # Exponential back-off, capped: 1, 2, then min(3, 4); full jitter scales by rng() = 1.
    assert sleeps == [1.0, 2.0, 3.0]
    assert (d.stats.retries, d.stats.failed) == (3, 1)


@pytest.mark.timeout(30)
def test_slow_server_never_blocks_enqueue(webhook_server: WebhookServer) -> None:
    """While a destination hangs 2 s per post, 1000 offers return at once, and a full queue
    drops the oldest low-severity notifications, never the critical ones."""
    webhook_server.script("/hook", *[Reply(200, b"ok", delay_s=2.0)] * 3)
    target = _target(webhook_server)
    info = replace(sample_notification(), severity="info")
    critical = sample_notification()

    async def go() -> tuple[float, float, Delivery, list[str]]:
        async with Delivery([target], queue_size=10) as d:
            d.offer("d", critical)
            # Wait (off the loop) until the worker is stuck in a slow post.
            assert await asyncio.to_thread(webhook_server.wait_for, 1, 5.0)
            t0 = time.perf_counter()
            worst = 0.0
            for i in range(1000):
                t = time.perf_counter()
                d.offer("d", critical if i % 100 == 0 else info)
                worst = max(worst, time.perf_counter() - t)
            total = time.perf_counter() - t0
            # The event loop is free too: a 10 ms sleep is not held up by the slow post.
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            loop_lag = time.perf_counter() - t
            queued = [n.severity for n in d._queues["d"].snapshot()]
            return total, max(worst, loop_lag - 0.01), d, queued

    total, worst, d, queued = asyncio.run(go())
    assert total < 0.5 and worst < 0.1, (total, worst)
    assert queued == ["critical"] * 10  # the 10 critical offers all kept
    assert d.stats.dropped == {"info": 990, "warning": 0, "critical": 0}
    assert d.stats.enqueued == 1001
    assert len(webhook_server.received) == 1  # the slow post is still the only one


def test_queue_keeps_fifo_across_severities_and_drops_oldest_lowest() -> None:
    from sinks.alert.delivery import _BoundedQueue

    base = sample_notification()
    ns = [
        replace(base, severity=s, key=f"k{i}")
        for i, s in enumerate("info warning critical info".split())
    ]

    async def go() -> tuple[list[str], list[str | None], list[str]]:
        q = _BoundedQueue(3)
        dropped = [q.put_nowait(n) for n in ns]  # the 4th (info) drops the oldest info, k0
        order = [n.key for n in q.snapshot()]
        got = [(await q.get()).key for _ in range(3)]
        return order, [d.key if d else None for d in dropped], got

    order, dropped, got = asyncio.run(go())
    assert dropped == [None, None, None, "k0"]
    assert order == got == ["k1", "k2", "k3"]
