"""The worker's guard against the Faust + aiokafka race that skipped messages after a
restart (``streams.app.faust_adapter``).

Faust passes its live set of active partitions to the consumer thread; aiokafka waits on
it for records and reads an *empty* set as "every partition". When Faust pauses all
partitions meanwhile (end of table recovery), aiokafka returned the stream's records,
moved past them, and Faust dropped them. The chaos suite reproduces it about once in ten
restarts (tests/chaos/test_kill.py); here the interleaving is forced: the fetcher stand-in
empties Faust's set while "waiting", as Faust's event loop did. Only aiokafka's fetcher is
replaced (its side of the race); the Faust consumer thread is the real class.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

from faust.types import TP

from streams.app.faust_adapter import _SnapshotConsumerThread

EVENTS = {TP("c4.events", p) for p in range(4)}
CHANGELOG = TP("comm-state-changelog", 0)


class Fetcher:
    """aiokafka's ``Fetcher.fetched_records`` semantics: an empty set means all."""

    _closed = False
    _subscriptions = SimpleNamespace(fetch_context=contextlib.nullcontext)

    def __init__(self, live: set[TP]) -> None:
        self.live = live
        self.asked: set[TP] | None = None

    async def fetched_records(self, partitions: set[TP], timeout: float, max_records: int):
        self.live.clear()  # Faust pauses every partition while the fetch waits
        await asyncio.sleep(0)
        self.asked = set(partitions)
        wanted = partitions or EVENTS | {CHANGELOG}  # aiokafka: empty = every partition
        return {tp: [f"record of {tp.topic}"] for tp in wanted}


def thread_with(fetcher: Fetcher) -> _SnapshotConsumerThread:
    thread = _SnapshotConsumerThread.__new__(_SnapshotConsumerThread)
    consumer = SimpleNamespace(_fetcher=fetcher, _closed=False, _max_poll_records=500)
    thread._ensure_consumer = lambda: consumer  # type: ignore[method-assign]

    async def call_thread(fn: Any, *args: Any, **kw: Any) -> Any:
        return await fn(*args, **kw)

    thread.call_thread = call_thread  # type: ignore[method-assign]
    thread.consumer = SimpleNamespace(flow_active=True)  # type: ignore[assignment]
    return thread


def test_fetch_uses_a_snapshot_so_no_stream_record_is_returned_for_dropping() -> None:
    live = {CHANGELOG}  # recovery: only the changelog is active, the streams are paused
    fetcher = Fetcher(live)
    records = asyncio.run(thread_with(fetcher).getmany(live, timeout=1.0))
    assert fetcher.asked == {CHANGELOG}
    assert set(records) == {CHANGELOG}  # no c4.events record fetched past and dropped


def test_an_empty_active_set_fetches_nothing() -> None:
    fetcher = Fetcher(set())
    assert asyncio.run(thread_with(fetcher).getmany(set(), timeout=1.0)) == {}
    assert fetcher.asked is None  # aiokafka was not asked for "every partition"


class StalledBuffer:
    """Faust's producer buffer when the broker stopped answering: its writes stay, and
    each ``flush_atmost`` returns after its 0.1-s stall (as Faust's does)."""

    size = 3

    async def flush_atmost(self, max_messages: int | None) -> int:
        await asyncio.sleep(0.1)
        return 0


def test_draining_table_writes_at_a_revoke_ends_at_its_deadline() -> None:
    """At a revoke the worker waits for its checkpoint writes for a bounded time, so a
    broker that stopped answering cannot hold the rebalance past its timeout; what is
    left is returned (and logged by the worker)."""
    from streams.app.faust_adapter import drain_table_writes

    app = SimpleNamespace(producer=SimpleNamespace(buffer=StalledBuffer()))
    loop = asyncio.new_event_loop()
    try:
        t0 = loop.time()
        left = loop.run_until_complete(drain_table_writes(app, timeout_s=0.5))
        took = loop.time() - t0
    finally:
        loop.close()
    assert left == 3
    assert 0.5 <= took < 1.5
