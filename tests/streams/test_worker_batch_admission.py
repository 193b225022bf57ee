"""Admission is checked once per consumer batch (issue 22: numpy costs per call, so the
batch's rows are looked at together), yet decides as message by message: what an
earlier message of the same batch changes (a lane's clock, a communicator's size) is
bounded, and a message that could be refused at its turn is checked at its turn.
Broker-free; each case would be admitted by a check against the state before the batch
alone."""

from __future__ import annotations

from typing import Any

import pytest

from producers.events import Event, OpEvent, encode_message
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter, EdgeLimits
from streams.app.engine import CoreEngine

T0 = 1_750_000_000_000_000
S = 1_000_000


def op(rank: int, ts: int, *, comm: str = "0xa", nranks: int = 4, **kw: Any) -> OpEvent:
    base: dict[str, Any] = dict(v=1, job="j", comm=comm, nranks=nranks, rank=rank,
                                host=f"node-{rank}", gpu=0, ts_us=ts, op="AllReduce",
                                seq=(ts - T0) // 1000 + 10, bytes=8, exec_us=10.0)  # fmt: skip
    base.update(kw)
    return OpEvent(**base)


def _reasons(messages: list[tuple[int, list[Event]]], one_batch: bool) -> list[tuple[str, str]]:
    r = CommRouter(CoreEngine(), lambda key: None, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=250_000,
                   limits=EdgeLimits(max_nranks=1024), clock=lambda: 0.0,
                   epoch=lambda: T0 / 1e6 + 7200)  # fmt: skip
    recs = [Record("ev", p, i, None, encode_message(evs)) for i, (p, evs) in enumerate(messages)]
    outs = [r.process(recs)] if one_batch else [r.process([rec]) for rec in recs]
    return [(d.source, d.reason) for o in outs for d in o.deadletters]


CASES = {
    # a new lane: its clock, set by the first message, leaves the second an hour behind
    "behind a clock set in the batch": [(0, [op(0, T0 + 3700 * S)]), (0, [op(1, T0)])],
    # ... or the second 11 min ahead of it (a lane busy: accepted a moment ago)
    "ahead of a clock set in the batch": [(0, [op(0, T0)]), (0, [op(1, T0 + 660 * S)])],
    # a communicator held in partition 0's lane, whose message in partition 1 moves it
    "behind a clock another partition's message moved": [
        (0, [op(0, T0)]),
        (1, [op(1, T0 + 3700 * S)]),
        (0, [op(2, T0 + 3700 * S - 10)]),
        (0, [op(3, T0 + 10 * S, comm="0xb")]),
    ],
    # the first message that fixes a size is refused (rank 5), the next fixes 8
    "a size fixed by an accepted message, not the first": [
        (0, [op(5, T0)]),
        (0, [op(0, T0, nranks=8)]),
        (0, [op(1, T0)]),
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_batch_decides_as_message_by_message(case: str) -> None:
    want = _reasons(CASES[case], one_batch=False)
    assert want, "the case refuses something"
    assert _reasons(CASES[case], one_batch=True) == want
