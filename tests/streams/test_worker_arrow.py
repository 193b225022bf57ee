"""The worker's router fed Arrow IPC batches: byte-identical decisions to JSON; bad
batches become dead letters with the reason."""

from __future__ import annotations

import struct
import zlib

import msgspec
import pytest

from producers.columnar import ARROW_CONTENT_TYPE, encode_arrow
from producers.events import Event, encode_message
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.app.deadletter import Record
from streams.app.detect_runner import EdgeLimits
from streams.app.watermark import Watermark, encode_watermark
from streams.commands import encode_command
from streams.verdicts import encode_verdict
from tests.streams.test_worker_router import ev, router, runner

SIM = msgspec.structs.replace(
    SCENARIOS["straggler"],
    hosts=4,
    duration_s=30,
    faults=[FaultSpec(kind="straggler", host=1, gpu=3, start_s=8, severity=1.5)],
)
CT = ARROW_CONTENT_TYPE.encode()


def _decide(records: list[Record], batch: int) -> tuple[list[bytes], list[bytes]]:
    """Verdicts and commands (encoded) of the router + correlator over ``records``."""
    r = router()
    outs = [r.process(records[i : i + batch]) for i in range(0, len(records), batch)]
    outs.append(r.close_slices())
    verdicts = [v for o in outs for v in o.verdicts]
    clocks = [c for o in outs for c in o.clocks]
    assert not any(o.deadletters for o in outs)
    c = runner()
    c.process(
        [
            Record("v", 0, i, None, encode_verdict(v), t)
            for i, (v, t) in enumerate(zip(verdicts, clocks, strict=True))
        ]
    )
    marks = [
        Record("wm", 0, i, None, encode_watermark(Watermark(partition=p, clock_us=t, job=j)))
        for i, ((p, j), t) in enumerate(r.clock_us.items())
    ]
    out = c.process(marks)
    return [encode_verdict(v) for v in verdicts], [encode_command(x) for x in out.commands]


@pytest.mark.parametrize("batch", [1, 64])
def test_json_and_arrow_messages_give_byte_identical_decisions(batch: int) -> None:
    trace: list[list[Event]] = [b for b in simulate(SIM) if b]

    def recs(arrow: bool) -> list[Record]:
        return [
            Record(
                "ev",
                zlib.crc32(b[0].comm.encode()) % 4,
                i,
                b[0].comm.encode(),
                encode_arrow(b) if arrow else encode_message(b),
                None,
                CT if arrow else None,
            )
            for i, b in enumerate(trace)
        ]

    js = _decide(recs(False), batch)
    ar = _decide(recs(True), batch)
    assert js[1], "the straggler should be isolated"
    assert ar == js


def test_bad_arrow_batches_are_dead_lettered_with_the_reason() -> None:
    good = encode_arrow([ev(1)])
    recs = [
        Record("ev", 0, 1, b"0xa", good, None, CT),
        Record("ev", 0, 2, b"0xa", good[: len(good) // 2], None, CT),
        Record("ev", 0, 3, b"0xa", encode_arrow([ev(2, rank=7)]), None, CT),
        Record("ev", 0, 4, b"0xa", encode_message([ev(3)]), None, b"text/csv"),
        Record("ev", 0, 5, b"0xa", encode_message([ev(4)]), None, None),
    ]
    r = router()
    out = r.process(recs)
    got = {dl.source: dl.reason for dl in out.deadletters}
    assert set(got) == {"ev[0]@2", "ev[0]@3", "ev[0]@4"}
    assert got["ev[0]@2"].startswith("undecodable message: not an Arrow IPC stream")
    assert "rank 7 is not below nranks 2" in got["ev[0]@3"]
    assert "unsupported content-type 'text/csv'" in got["ev[0]@4"]
    assert r.stats.events == 2  # the good JSON and the good Arrow message


def test_bad_arrow_messages_among_good_ones_are_dead_lettered_and_the_rest_judged() -> None:
    # a string column whose last offset points far past its data: only a full validation
    # of each batch, before the batch's messages are put together, catches it
    data = encode_arrow(
        [msgspec.structs.replace(ev(1), host=h * n) for h, n in (("a", 77), ("b", 99))]
    )
    offsets = struct.pack("<3i", 0, 77, 176)
    assert data.count(offsets) == 1
    crafted = data.replace(offsets, struct.pack("<3i", 0, 77, 1 << 20))
    good = [encode_arrow([ev(t, rank=r)]) for t in (2, 3) for r in (0, 1)]
    values = [good[0], crafted, good[1], encode_arrow([ev(3, rank=5)]), good[2], b"\xff" * 9]
    values.append(good[3])
    r = router(limits=EdgeLimits(max_message_bytes=4096))
    out = r.process([Record("ev", 0, i, b"0xa", v, None, CT) for i, v in enumerate(values)])
    got = {dl.source: dl.reason for dl in out.deadletters}
    assert set(got) == {"ev[0]@1", "ev[0]@3", "ev[0]@5"}
    assert got["ev[0]@1"].startswith("undecodable message: not an Arrow IPC stream")
    assert "rank 5 is not below nranks 2" in got["ev[0]@3"]
    assert got["ev[0]@5"].startswith("undecodable message: not an Arrow IPC stream")
    assert r.stats.events == 4
    big = r.process([Record("ev", 0, 9, b"0xa", encode_arrow([ev(4)] * 40), None, CT)])
    assert "is over the limit of 4096" in big.deadletters[0].reason
    # the good messages go on to be judged: the communicator's open slice holds them
    groups = [g for lane in r.pending.values() for g in lane.values()]
    assert [(g.n, [rec.source for rec, _ in g.parts]) for g in groups] == [
        (4, ["ev[0]@0", "ev[0]@2", "ev[0]@4", "ev[0]@6"])
    ]
    assert r.close_slices().deadletters == []


def test_a_batch_of_hostile_identities_is_previewed_without_harm() -> None:
    """The batch's membership is read before admission (streams/app/membership.py), so
    from rows the contract has not checked yet: GPUs of 2**31 - 1 and -5, a null and a
    host name no contract allows must not break it (its keys are built from codes)."""

    def who(rank: int, **kw: object) -> Event:
        return msgspec.structs.replace(ev(1, rank=rank), nranks=4, **kw)

    hostile = [who(0, gpu=2**31 - 1), who(1, gpu=-5), who(2, gpu=None), who(3, host="node-\u202e")]
    r = router()
    out = r.process([Record("ev", 0, i, b"0xa", encode_arrow([e]), None, CT)
                     for i, e in enumerate(hostile)])  # fmt: skip
    assert len(out.deadletters) + r.stats.events > 0  # judged or refused, not crashed
    r.members.preview(None)  # an empty batch clears it
    assert r.members._batch == {}
