"""The exporter with windows at the source (``summary_k``) through the real broker:
what it publishes is, per communicator, the samples and one summary per rank and
window — the numbers of every collective it read — and nothing is lost or repeated."""

from __future__ import annotations

from pathlib import Path

import pytest

from producers.columnar import content_type_of
from producers.events import OpEvent
from producers.exporter import Exporter
from producers.summary import SummaryEvent, decode_with_summaries, is_sample
from tests.kafka_helpers import consume
from tests.producers.test_exporter import COMM_A, COMM_B, FakeClock, _append, _config, _line


@pytest.mark.kafka
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["json", "arrow"])
def test_exporter_sends_summaries_and_seq_coherent_samples(
    tmp_path: Path, kafka_bootstrap: str, make_topics, fmt: str
) -> None:
    topics = make_topics({"events": 4, "deadletter": 1})
    d = tmp_path / "nccl-inspector-77"
    d.mkdir()
    clock = FakeClock()
    state = tmp_path / "positions.json"
    ex = Exporter(
        _config(d, kafka_bootstrap, topics, format=fmt, summary_k=4, state_file=state), clock=clock
    )
    seqs = range(1, 41)
    _append(d / "node-001-pid100.log", b"".join(_line(COMM_A, 0, s) for s in seqs))
    _append(d / "node-001-pid101.log", b"".join(_line(COMM_A, 1, s) for s in seqs))
    _append(d / "node-002-pid102.log", b"".join(_line(COMM_B, 2, s, "node-002") for s in seqs))
    ex.poll_once(publish=True)
    ex.close()
    assert ex.stats.events == 120 and ex.stats.delivered == ex.stats.messages == 2
    msgs = consume(kafka_bootstrap, topics["events"], expect=2)
    recs = {
        m.key().decode(): decode_with_summaries(m.value(), content_type_of(m.headers()))
        for m in msgs
    }
    assert set(recs) == {COMM_A, COMM_B}
    picked = [s for s in seqs if is_sample(s, 4)]
    for comm, ranks in ((COMM_A, (0, 1)), (COMM_B, (2,))):
        got = recs[comm]
        summaries = {r.rank: r for r in got if isinstance(r, SummaryEvent)}
        assert sorted(summaries) == list(ranks)
        for rank in ranks:
            samples = [r.seq for r in got if isinstance(r, OpEvent) and r.rank == rank]
            assert samples == picked  # the same seqs on every rank
            s = summaries[rank]
            assert (s.count, s.seq_first, s.seq_last, s.sample_k) == (40, 1, 40, 4)
            assert s.exec_sum_us == sum(500 + q for q in seqs)  # _line: exec_us = 500 + sn
            assert (s.exec_min_us, s.exec_max_us) == (501, 540)
    assert consume(kafka_bootstrap, topics["deadletter"], expect=0, timeout=3) == []
    # a restart reads nothing again: the positions passed every line sent
    ex2 = Exporter(
        _config(d, kafka_bootstrap, topics, format=fmt, summary_k=4, state_file=state), clock=clock
    )
    ex2.poll_once(publish=True)
    ex2.close()
    assert ex2.stats.events == 0
