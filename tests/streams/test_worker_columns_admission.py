"""The worker's admission decides alike on every input kind (issue 23: one path, for
columns): a message sent as JSON and the same message sent as Arrow get the same
admission outcome — the same dead letters with the same reasons, the same clocks, sizes
and corroboration state, the same verdicts — whatever the batching and however JSON and
Arrow messages are mixed in one batch; and every rule is exercised. Broker-free."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from producers.columnar import ARROW_CONTENT_TYPE, encode_arrow
from producers.events import Conn, Event, OpEvent, ProgressEvent, encode_message
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter, EdgeLimits
from streams.app.engine import CoreEngine
from streams.verdicts import encode_verdict

T0 = 1_750_000_000_000_000
S = 1_000_000
CT = ARROW_CONTENT_TYPE.encode()


def op(rank: int, ts: int, *, comm: str = "0xa", nranks: int = 4, **kw: Any) -> OpEvent:
    base: dict[str, Any] = dict(v=1, job="j", comm=comm, nranks=nranks, rank=rank,
                                host=f"node-{rank}", gpu=0, ts_us=ts, op="AllReduce",
                                seq=(ts - T0) // 1000 + 4_000_000, bytes=8,
                                exec_us=10.0 + rank)  # fmt: skip
    base.update(kw)
    return OpEvent(**base)


def hb(rank: int, ts: int, started: int, *, comm: str = "0xa", **kw: Any) -> ProgressEvent:
    base: dict[str, Any] = dict(v=1, job="j", comm=comm, nranks=4, rank=rank,
                                host=f"node-{rank}", gpu=0, ts_us=ts, started=started,
                                completed=started)  # fmt: skip
    base.update(kw)
    return ProgressEvent(**base)


def ranks(ts: int, **kw: Any) -> list[Event]:
    return [op(r, ts, **kw) for r in range(4)]


SEND2 = Conn(peer=2, dir="send", bytes=8)
K: dict[str, Any] = {"comm": "0xd", "job": "k"}

# (wall clock in s, partition, events) per message; consecutive messages with the same
# wall clock form a step (a consumer batch, unless split further)
MESSAGES: list[tuple[float, int, list[Event]]] = [
    (0, 0, ranks(T0)),
    (0, 0, ranks(T0, comm="0xb", nranks=4)),
    (0, 0, [op(0, T0, nranks=2048, comm="0xbig")]),  # over max_nranks
    (0, 0, [op(0, T0 + S), op(1, T0 + S, nranks=8)]),  # 0xa changes size (row 1)
    (0, 0, [op(0, T0 + S), op(5, T0 + S)]),  # rank not below nranks (row 1)
    (0, 0, [op(1, T0 + S, conns=[SEND2, Conn(peer=9, dir="recv", bytes=8)])]),  # peer 9
    (0, 0, [op(2, T0 + S, conns=[Conn(peer=3, dir="send", bytes=8, time_us=2.0)])]),
    (0, 0, [op(0, T0 + 400 * 24 * 3600 * S)]),  # beyond the wall clock
    (0, 0, [op(0, T0 + 2 * S), op(1, T0 + 603 * S)]),  # ahead of the lane's clock (row 1)
    (0, 0, [op(3, T0 - 3601 * S)]),  # an hour behind the lane's clock
    (0, 1, ranks(T0 - 3601 * S, comm="0xc")),  # another partition: its own lane, fine
    (0, 0, ranks(T0 + 2 * S, comm="0xd", job="k")),  # another job in partition 0
    (0, 0, [op(0, T0 + 2 * S, comm="0xe", nranks=2), op(1, T0 + 2 * S, comm="0xe", nranks=4)]),
    (0, 0, [op(0, T0 + 3 * S), op(0, T0 + 3 * S, comm="0xb")]),  # two communicators
    (0, 0, [op(1, T0 + 3 * S), op(1, T0 + 3 * S, comm="0xd", job="k")]),  # two jobs
    (0, 0, [hb(r, T0 + 3 * S, 10) for r in range(4)]),
    (0, 0, [hb(1, T0 + 4 * S, 13), hb(2, T0 + 4 * S, 11)]),
    (0, 0, [hb(1, T0 + 5 * S, 11)]),  # rank 1's heartbeat goes back: two sources
    (1, 0, [op(2, T0 + 6 * S, seq=4_006_500, exec_us=5.0)]),
    # re-encoded (not byte for byte: an exact repeat is dropped before): no contradiction
    (1, 0, [op(2, T0 + 6 * S, seq=4_006_500, exec_us=5.0, algo="ring")]),
    (1, 0, [op(2, T0 + 6 * S, seq=4_006_500, exec_us=900.0, comm="0xb")]),
    (1, 0, [op(2, T0 + 6 * S, seq=4_006_500, exec_us=700.0, comm="0xb")]),  # other duration
    (1, 0, [op(3, T0 + 7 * S, seq=4_007_600, **K), op(2, T0 + 7 * S, seq=4_007_400, **K)]),
    (1, 0, [op(2, T0 + 7 * S, seq=4_007_300, **K)]),  # seq goes back
    (1, 0, [op(3, T0 + 8 * S, seq=4_008_000, comm="0xf"), op(3, T0 + 8 * S, seq=4_008_000)]),
    (1, 0, [op(3, T0 + 8 * S, seq=4_007_900, comm="0xf")]),  # behind the two-comm message
    (1, 0, [hb(r, T0 + 9 * S, 10, comm="0xh") for r in range(4)]),
    # a heartbeat one collective on, "in it for 30 s" a second after the last: two sources
    (1, 0, [hb(0, T0 + 10 * S, 11, comm="0xh", inflight_op="AllReduce", inflight_us=30e6)]),
    (1, 0, [hb(1, T0 + 10 * S, 11, comm="0xh", inflight_op="AllReduce", inflight_us=4e5)]),
    (1, 0, [hb(0, T0 + 11 * S, 5, comm="0xi")]),
    (1, 0, [hb(0, T0 + 10 * S, 6, comm="0xi")]),  # stamped earlier, says more: two sources
    (1, 0, ranks(T0 + 40 * S)),
    (1, 0, ranks(T0 + 41 * S)),
    (1, 0, ranks(T0 + 20 * S, seq=4_050_000)),  # late: 0xa was judged up to T0 + 40 s
    (1, 0, ranks(T0 + 620 * S)),  # 580 s ahead of the lane's clock: fine
    (2, 0, ranks(T0 + 1300 * S)),  # 680 s ahead, lane busy a second ago: refused
    (700, 0, ranks(T0 + 1300 * S)),  # quiet for 699 s: traffic resuming
    (700, 0, ranks(T0 + 1301 * S, comm="0xb")),
]


def _record(i: int, p: int, events: list[Event], arrow: bool) -> Record:
    value = encode_arrow(events) if arrow else encode_message(events)
    return Record("ev", p, i, events[0].comm.encode(), value, None, CT if arrow else None)


def _run(fmt: str, split: bool) -> dict[str, Any]:
    wall = [0.0]
    r = CommRouter(CoreEngine(), lambda key: None, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=250_000,
                   limits=EdgeLimits(max_nranks=1024), clock=lambda: wall[0],
                   epoch=lambda: T0 / 1e6 + 3000)  # fmt: skip
    recs = [
        (w, _record(i, p, evs, fmt == "arrow" or (fmt == "mixed" and i % 3 != 1)))
        for i, (w, p, evs) in enumerate(MESSAGES)
    ]
    outs = []
    steps = sorted({w for w, _ in recs})
    for w in steps:
        wall[0] = w
        batch = [rec for x, rec in recs if x == w]
        for part in [[rec] for rec in batch] if split else [batch]:
            outs.append(r.process(part, settle={0} if split else ()))
    outs.append(r.close_slices())
    return {
        "deadletters": [(d.source, d.reason) for o in outs for d in o.deadletters],
        "verdicts": [encode_verdict(v) for o in outs for v in o.verdicts],
        "clocks": [c for o in outs for c in o.clocks],
        "events": r.stats.events,
        "clock_us": r.clock_us,
        "sizes": r.sizes,
        "contested": r.contested,
        "progress": r.ledger.progress,
        "ops": r.ledger.ops,
        "late": r.late_events,
        "judged": {k: c.judged_us for k, c in r.comms.items()},
    }


@pytest.mark.parametrize("split", [False, True], ids=["one-batch", "message-by-message"])
@pytest.mark.parametrize("fmt", ["arrow", "mixed"])
def test_json_and_arrow_get_the_same_admission_outcome(fmt: str, split: bool) -> None:
    want = _run("json", split)
    got = _run(fmt, split)
    for key in want:
        assert got[key] == want[key], key
    reasons = [reason for _, reason in want["deadletters"]]
    # every rule was exercised (the comparison above would pass on an empty run)
    for needle in ("over the limit of 1024", "has 4 ranks, this event says 8",
                   "event 1: rank 5 is not below nranks 4", "peer 9 is not below nranks 4",
                   "further ahead of the wall clock", "event 1: ts_us", "s behind its",
                   "has 2 ranks, this event says 4", "late by 2", "680s ahead"):  # fmt: skip
        assert sum(needle in x for x in reasons) == 1, needle
    assert len(reasons) == 10
    why = {comm: w for comm, (_, w) in want["contested"].items()}
    assert set(why) == {"0xa", "0xb", "0xd", "0xf", "0xh", "0xi"}
    assert "in collective 11 for 30.0 s" in why["0xh"] and "one stamped later" in why["0xi"]
    assert "went back from seq 4008000 to 4007900" in why["0xf"]
    assert "heartbeat went back" in why["0xa"] and "different durations" in why["0xb"]
    assert "went back from seq 4007400 to 4007300" in why["0xd"]
    assert want["clock_us"][(0, "j")] == T0 + 1301 * S and (1, "j") in want["clock_us"]


def test_a_message_of_several_communicators_is_split_like_its_objects() -> None:
    evs = [op(0, T0, comm="0xb"), op(0, T0), op(1, T0, comm="0xb")]
    outs = {fmt: _decide_one(evs, fmt == "arrow") for fmt in ("json", "arrow")}
    assert outs["arrow"] == outs["json"] and outs["json"][0] == 3


def _decide_one(events: list[Event], arrow: bool) -> tuple[int, dict[str, int]]:
    r = _router()
    out = r.process([_record(0, 0, events, arrow)])
    assert not out.deadletters
    return r.stats.events, {k: g.n for lane in r.pending.values() for k, g in lane.items()}


def test_the_contested_reason_names_the_same_values_both_ways() -> None:
    a = msgspec.structs.replace(op(1, T0, seq=5), exec_us=10.25)
    b = msgspec.structs.replace(a, exec_us=99.5)
    got = {}
    for fmt in ("json", "arrow"):
        r = _router()
        r.process([_record(0, 0, [a], fmt == "arrow"), _record(1, 0, [b], fmt == "arrow")])
        got[fmt] = r.contested["0xa"][1]
    assert got["arrow"] == got["json"] and "(10.25 and 99.5 us)" in got["json"]


def test_a_restored_communicator_keeps_its_size_for_arrow_messages_too() -> None:
    r0 = _router()
    r0.process([_record(0, 0, ranks(T0), False)])
    [(_, key, state)] = r0.flush().checkpoints
    reasons = {}
    for fmt in ("json", "arrow"):
        r1 = _router(lookup={key: state}.get)
        out = r1.process([_record(1, 0, ranks(T0 + S, nranks=8), fmt == "arrow")])
        reasons[fmt] = [d.reason for d in out.deadletters]
        assert r1.stats.restored == 1
    assert reasons["arrow"] == reasons["json"] and "has 4 ranks" in reasons["json"][0]


class _Fragile:
    """A detector that fails on a batch holding seq 666, whichever way it is given."""

    def observe(self, cols: Any) -> list[Any]:
        if (cols.int("seq") == 666).any():
            raise RuntimeError("boom")
        return []

    def advance(self, now_us: int) -> list[Any]:
        return []

    def to_bytes(self) -> bytes:
        return b""


class _FragileEngine:
    def new_detector(self, comm: str) -> _Fragile:
        return _Fragile()


@pytest.mark.parametrize("fmt", ["json", "arrow"])
def test_a_detector_failure_dead_letters_only_the_message_it_failed_on(fmt: str) -> None:
    r = _router(engine=_FragileEngine())
    evs = [[op(0, T0, seq=1)], [op(1, T0, seq=666)], [op(2, T0, seq=2)]]
    r.process([_record(i, 0, e, fmt == "arrow") for i, e in enumerate(evs)])
    out = r.close_slices()
    assert [(d.source, d.reason) for d in out.deadletters] == [
        ("ev[0]@1", "detector error in communicator 0xa: RuntimeError: boom")
    ]
    assert r.stats.detector_errors == 1 and r.stats.events == 3


def _router(engine: Any = None, lookup: Any = None) -> CommRouter:
    return CommRouter(engine or CoreEngine(), lookup or (lambda key: None),
                      checkpoint_every_events=10**9, checkpoint_every_s=1e9,
                      advance_every_us=250_000, epoch=lambda: T0 / 1e6)  # fmt: skip
