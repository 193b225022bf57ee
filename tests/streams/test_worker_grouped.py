"""The worker judges a slice's Arrow-fed communicators together
(``streams.core.group``'s cut and fold once for all): the same verdicts, commands and
detector state as judging them one by one, and a detector failure still dead-letters
only the messages of the communicator that failed — also when the shared cut itself
fails and the slice is judged one by one. Broker-free."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from producers.columnar import ARROW_CONTENT_TYPE, EventColumns, decode_block, encode_arrow
from producers.events import Conn, Event, encode_message
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.app import comm_slices
from streams.app.deadletter import Record
from streams.core import CommDetector, DetectConfig
from streams.core.cut import Cut
from tests.streams.test_worker_arrow import _decide
from tests.streams.test_worker_columns_admission import hb, op
from tests.streams.test_worker_router import router

CT = ARROW_CONTENT_TYPE.encode()
SIM = msgspec.structs.replace(
    SCENARIOS["healthy"], hosts=8, duration_s=40, seed=5, pp=2,
    faults=[
        FaultSpec(kind="straggler", host=2, gpu=3, start_s=6, end_s=18, severity=1.6),
        FaultSpec(kind="rank_hang", host=5, gpu=2, start_s=26),
    ],
)  # fmt: skip


@pytest.fixture(scope="module")
def records() -> list[Record]:
    trace = [b for b in simulate(SIM) if b]
    return [
        Record("ev", 0, i, b[0].comm.encode(), encode_arrow(b), None, CT)
        for i, b in enumerate(trace)
    ]


def _spy(monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> list[int]:
    """Counts the grouped cuts (and makes them fail when ``fail``)."""
    calls: list[int] = []
    real = comm_slices.cut_many

    def cut_many(parts: Any) -> list[Cut]:
        calls.append(len(parts))
        if fail:
            raise RuntimeError("cut failed")
        return real(parts)

    monkeypatch.setattr(comm_slices, "cut_many", cut_many)
    return calls


@pytest.mark.parametrize("batch", [16, 400])
def test_grouped_judging_equals_one_by_one_with_a_hang_and_a_straggler(
    records: list[Record], batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy(monkeypatch)
    grouped = _decide(records, batch)
    assert calls and max(calls) >= 4  # several communicators per slice were grouped
    monkeypatch.setattr(comm_slices, "GROUP_MIN", 10**9)  # every communicator alone
    n = len(calls)
    alone = _decide(records, batch)
    assert len(calls) == n
    assert grouped == alone
    verdicts, commands = grouped
    kinds = {msgspec.json.decode(v)["fault"] for v in verdicts}
    assert {"straggler", "noncomm_hang"} <= kinds, kinds
    assert commands


def _state(records: list[Record], batch: int) -> dict[str, bytes]:
    r = router()
    for i in range(0, len(records), batch):
        r.process(records[i : i + batch])
    r.close_slices()
    return {c: x.detector.to_bytes() for c, x in r.comms.items()}


def test_grouped_judging_leaves_the_same_detector_state(
    records: list[Record], monkeypatch: pytest.MonkeyPatch
) -> None:
    grouped = _state(records, 200)
    monkeypatch.setattr(comm_slices, "GROUP_MIN", 10**9)
    assert grouped == _state(records, 200)


class _Fragile(CommDetector):
    """A real detector that fails on a batch holding seq 666, however it is cut."""

    def observe_cut(self, c: Cut) -> list[Any]:
        if (c.seq == 666).any():
            raise RuntimeError("boom")
        return super().observe_cut(c)


class _FragileEngine:
    def new_detector(self, comm: str) -> CommDetector:
        return _Fragile(comm, DetectConfig())


def _ops(comm: str, seq: int, ts: int) -> list[Event]:
    return [op(r, ts, comm=comm, seq=seq) for r in range(4)]


@pytest.mark.parametrize("cut_fails", [False, True], ids=["detector-fails", "cut-fails"])
def test_a_failure_in_a_group_dead_letters_only_its_communicators_message(
    cut_fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy(monkeypatch, fail=cut_fails)
    t = 1_750_000_000_000_000
    msgs = [_ops("0xa", 1, t), _ops("0xb", 1, t), _ops("0xa", 666, t), _ops("0xc", 1, t)]
    r = router(engine=_FragileEngine())
    recs = [Record("ev", 0, i, m[0].comm.encode(), encode_arrow(m), None, CT)
            for i, m in enumerate(msgs)]  # fmt: skip
    r.process(recs)
    out = r.close_slices()
    assert calls == [3]  # 0xa, 0xb, 0xc in one group
    # 0xa's slice of two messages failed together, then message by message: only the
    # one holding seq 666 is dead-lettered; 0xb and 0xc were judged
    assert [(d.source, d.reason) for d in out.deadletters] == [
        ("ev[0]@2", "detector error in communicator 0xa: RuntimeError: boom")
    ]
    assert r.stats.detector_errors == 1
    assert {c: x.detector.n_events for c, x in r.comms.items()} == {
        "0xa": len(msgs[0]), "0xb": len(msgs[1]), "0xc": len(msgs[3])
    }  # fmt: skip


LINK_HANG = msgspec.structs.replace(
    SCENARIOS["healthy"], hosts=8, duration_s=40, seed=7,
    faults=[FaultSpec(kind="link_hang", host=6, nic=3, peer_host=7, start_s=24)],
)  # fmt: skip


def test_in_flight_progress_connections_are_read_as_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A link hang (heartbeats with per-connection bytes and retransmits while an op is
    in flight) found alike from JSON objects and from Arrow columns, the columns giving
    the hang detector their connections as integer arrays, not event objects."""
    trace = [b for b in simulate(LINK_HANG) if b]
    got: list[int] = []
    real = EventColumns.progress_conns

    def spy(self: EventColumns, idx: Any) -> Any:
        out = real(self, idx)
        got.append(0 if out is None else int(out[0][-1]))
        return out

    monkeypatch.setattr(EventColumns, "progress_conns", spy)
    arrow = _decide(
        [Record("ev", 0, i, b[0].comm.encode(), encode_arrow(b), None, CT)
         for i, b in enumerate(trace)], 64,
    )  # fmt: skip
    json = _decide(
        [Record("ev", 0, i, b[0].comm.encode(), encode_message(b)) for i, b in enumerate(trace)],
        64,
    )
    assert arrow == json
    assert "comm_hang" in {msgspec.json.decode(v)["fault"] for v in arrow[0]}
    assert got and min(got) >= 0 and sum(got) > 0  # connections came as arrays


def test_progress_conns_are_the_events_connections() -> None:
    evs = [
        hb(0, 1_000, 5, completed=4, conns=[Conn(peer=1, dir="send", bytes=7, retrans=2),
                                           Conn(peer=2, dir="recv", bytes=2**60)]),
        hb(1, 1_000, 5),
        hb(2, 1_000, 5, completed=4, conns=[Conn(peer=0, dir="recv", bytes=3)]),
    ]  # fmt: skip
    _, block = decode_block([(encode_arrow(evs), CT)])
    assert block is not None
    cols = block.columns("0xa", [(0, 3)])
    off, peer, send, nbytes, retrans = cols.progress_conns(np.array([2, 0]))
    assert off.tolist() == [0, 1, 3]
    assert peer.tolist() == [0, 1, 2] and send.tolist() == [False, True, False]
    assert nbytes.tolist() == [3, 7, 2**60] and retrans.tolist() == [0, 2, 0]
    # several spans (a slice of several messages) keep them too
    two = block.columns("0xa", [(0, 1), (2, 3)]).progress_conns(np.array([1]))
    assert two is not None and two[1].tolist() == [0]
