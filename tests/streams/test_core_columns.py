"""The core's one way in, columns, from either input kind: events read as objects (a
JSON trace, the simulator: :class:`streams.core.columns.EventRows` at the edge) and the
same events read as Arrow columns give the same verdicts and the same state
(checkpoint bytes)."""

from __future__ import annotations

import msgspec
import pytest

from producers.columnar import decode_arrow, encode_arrow
from producers.events import Event
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.core import CommDetector, DetectConfig, DetectionPipeline
from streams.core.columns import PartsBlock
from streams.verdicts import encode_verdict

SIM = msgspec.structs.replace(
    SCENARIOS["healthy"],
    hosts=8,
    duration_s=40,
    seed=9,
    faults=[
        FaultSpec(kind="straggler", host=2, gpu=3, start_s=6, end_s=20, severity=1.6),
        FaultSpec(kind="slow_link", host=4, nic=1, peer_host=5, start_s=10, severity=0.4),
        FaultSpec(kind="link_hang", host=6, nic=3, peer_host=7, start_s=30),
    ],
)


@pytest.fixture(scope="module")
def trace() -> list[list[Event]]:
    return [b for b in simulate(SIM) if b]


def test_objects_and_arrow_columns_give_the_same_verdicts_and_state(
    trace: list[list[Event]],
) -> None:
    cfg = DetectConfig()
    by_obj: dict[str, CommDetector] = {}
    by_col: dict[str, CommDetector] = {}
    got_obj: list[bytes] = []
    got_col: list[bytes] = []
    for batch in trace:
        comm = batch[0].comm
        a = by_obj.setdefault(comm, CommDetector(comm, cfg))
        b = by_col.setdefault(comm, CommDetector(comm, cfg))
        got_obj += [encode_verdict(v) for v in a.observe(batch)]
        (cols,) = decode_arrow(encode_arrow(batch))
        got_col += [encode_verdict(v) for v in b.observe(cols)]
    assert got_obj, "the faults give verdicts"
    assert got_col == got_obj
    assert all(by_col[c].to_bytes() == by_obj[c].to_bytes() for c in by_obj)


def test_pipeline_fed_arrow_columns_decides_like_fed_objects(trace: list[list[Event]]) -> None:
    a, b = DetectionPipeline(), DetectionPipeline()
    for batch in trace:
        a.feed(batch)
        b.feed_block(PartsBlock(decode_arrow(encode_arrow(batch))))
    a.finish()
    b.finish()
    assert a.commands, "the faults are isolated"
    assert [encode_verdict(v) for v in b.verdicts] == [encode_verdict(v) for v in a.verdicts]
    assert b.commands == a.commands
