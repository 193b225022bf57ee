"""Windows at the source (producers/summary.py): the summariser's numbers against numpy,
seq-coherent sampling, the contract extension (schema, JSON and Arrow), what a reader
that knows only op and progress does with it, and the expansion at the edge."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import numpy as np
import pytest

from producers.columnar import ARROW_CONTENT_TYPE, decode_block, decode_events
from producers.events import Conn, EventDecodeError, OpEvent, ProgressEvent, decode_message
from producers.summary import (
    ExpandStats,
    Summariser,
    SummaryEvent,
    decode_expanded,
    decode_with_summaries,
    encode_summary_message,
    expand,
    is_sample,
    sample_mask,
    summarised,
)
from producers.summary_arrow import encode_arrow_with_summaries
from streams.core.slow_conn import ConnMatrix

SCHEMA = json.loads(
    (Path(__file__).parents[2] / "producers/contracts/collective-event.schema.json").read_text()
)
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _ops(rank: int, n: int, rng: np.random.Generator, *, seq0: int = 100, nranks: int = 4):
    """n collectives of one rank, with random kernel times and per-peer traffic."""
    out = []
    for i in range(n):
        conns = [
            Conn(peer=p, dir=d, bytes=int(rng.integers(1, 1 << 20)),
                 time_us=float(rng.uniform(1, 500)), retrans=int(rng.integers(0, 3)))
            for p in range(nranks) if p != rank for d in ("send", "recv")
        ]  # fmt: skip
        out.append(
            OpEvent(
                v=1, job="j", comm="0xc", nranks=nranks, rank=rank, host=f"node-{rank:03d}",
                gpu=rank, nic="mlx5_0", ts_us=1_000_000 + i * 997 + rank, op="AllReduce",
                seq=seq0 + i, bytes=int(rng.integers(1, 1 << 24)),
                exec_us=float(rng.lognormal(6, 1)), conns=conns,
            )
        )  # fmt: skip
    return out


def _summary(recs: list) -> SummaryEvent:
    """The first summary of a message."""
    return next(r for r in recs if isinstance(r, SummaryEvent))


def test_summary_numbers_equal_numpy() -> None:
    rng = np.random.default_rng(7)
    ops = _ops(1, 1500, rng)
    s = Summariser(k=32)
    for ev in ops:
        s.add(ev)
    (recs, _), = s.flush().values()  # fmt: skip
    summ = _summary(recs)
    x = np.array([e.exec_us for e in ops])
    assert summ.count == len(ops) and (summ.seq_first, summ.seq_last) == (100, 1599)
    assert summ.bytes == sum(e.bytes for e in ops)
    assert summ.exec_sum_us == pytest.approx(x.sum(), rel=1e-12)
    assert (summ.exec_min_us, summ.exec_max_us) == (x.min(), x.max())
    assert summ.exec_p50_us == pytest.approx(np.percentile(x, 50), rel=1e-12)
    assert summ.exec_p90_us == pytest.approx(np.percentile(x, 90), rel=1e-12)
    assert (summ.win_start_us, summ.ts_us) == (ops[0].ts_us, ops[-1].ts_us)
    want: dict[tuple[int, str], list[float]] = {}
    for e in ops:
        for c in e.conns or ():
            acc = want.setdefault((c.peer, c.dir), [0, 0.0, 0])
            acc[0] += c.bytes
            acc[1] += c.time_us or 0.0
            acc[2] += c.retrans or 0
    got = {(c.peer, c.dir): [c.bytes, c.time_us, c.retrans] for c in summ.peers or ()}
    assert got.keys() == want.keys()
    for key, (b, t, r) in want.items():
        assert got[key][0] == b and got[key][2] == r
        assert got[key][1] == pytest.approx(t, rel=1e-12)
    samples = [r for r in recs if isinstance(r, OpEvent)]
    assert samples == [e for e in ops if is_sample(e.seq, 32)]  # sent whole, unchanged
    assert summ.samples == len(samples)


def test_sampling_picks_the_same_seqs_on_every_rank_and_about_one_in_k() -> None:
    seqs = np.arange(0, 200_000)
    for k in (1, 16, 64, 257):
        mask = sample_mask(seqs, k)
        assert mask.tolist()[:5000] == [is_sample(int(q), k) for q in seqs[:5000]]
        assert abs(mask.mean() - 1 / k) < 0.15 / k
    # not a modulus: a pattern repeating every 8 collectives is sampled at every phase
    picked = np.flatnonzero(sample_mask(seqs, 64))
    assert len(set((picked % 8).tolist())) == 8
    # every run of 64 * 20 collectives holds samples (a window always has a carrier)
    runs = np.add.reduceat(sample_mask(seqs, 64).astype(int), np.arange(0, len(seqs), 1280))
    assert runs.min() > 0
    # four ranks whose windows are cut at different times pick the same seqs
    rng = np.random.default_rng(1)
    picks = []
    for rank in range(4):
        s = Summariser(k=16)
        got: list[int] = []
        for i, ev in enumerate(_ops(rank, 800, rng)):
            s.add(ev)
            if (i + 37 * rank) % 150 == 0:
                got += [
                    r.seq for recs, _ in s.flush().values() for r in recs if isinstance(r, OpEvent)
                ]
        got += [
            r.seq
            for recs, _ in s.flush(force=True).values()
            for r in recs
            if isinstance(r, OpEvent)
        ]
        picks.append(got)
    assert picks[0] == picks[1] == picks[2] == picks[3] and len(picks[0]) > 20


def _message(k: int = 8) -> list:
    rng = np.random.default_rng(3)
    s = Summariser(k=k)
    for rank in range(4):
        for ev in _ops(rank, 200, rng):
            s.add(ev)
    (recs, _), = s.flush().values()  # fmt: skip
    prog = ProgressEvent(v=1, job="j", comm="0xc", nranks=4, rank=0, host="node-000",
                         ts_us=1_300_000, started=300, completed=300)  # fmt: skip
    return [prog, *recs]


def test_summary_messages_validate_against_the_schema_and_round_trip_json_and_arrow() -> None:
    recs = _message()
    data = encode_summary_message(recs)
    VALIDATOR.validate(json.loads(data))
    for r in recs:
        VALIDATOR.validate(json.loads(msgspec.json.encode(r)))
    assert decode_with_summaries(data) == recs
    value, headers = encode_arrow_with_summaries(recs)
    assert headers == [("content-type", ARROW_CONTENT_TYPE.encode())]
    assert decode_with_summaries(value, ARROW_CONTENT_TYPE) == recs
    assert decode_expanded(value, ARROW_CONTENT_TYPE) == decode_expanded(data) == expand(recs)


def _bad_summaries() -> list[tuple[str, dict[str, Any]]]:
    doc = json.loads(msgspec.json.encode(_summary(_message())))

    def mut(**kw: Any) -> dict[str, Any]:
        d = copy.deepcopy(doc)
        for k, v in kw.items():
            if v is None:
                del d[k]
            else:
                d[k] = v
        return d

    return [
        ("sv2", mut(sv=2)),
        ("count0", mut(count=0)),
        ("no_count", mut(count=None)),
        ("neg_p50", mut(exec_p50_us=-1.0)),
        ("peer_dir", mut(peers=[{"peer": 1, "dir": "up", "bytes": 3}])),
        ("no_sample_k", mut(sample_k=None)),
    ]


@pytest.mark.parametrize(("name", "doc"), _bad_summaries(), ids=[n for n, _ in _bad_summaries()])
def test_the_schema_and_the_decoder_both_refuse_a_bad_summary(name: str, doc: dict) -> None:
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(doc)
    with pytest.raises(EventDecodeError):
        decode_with_summaries(json.dumps([doc]).encode())


def test_rules_beyond_the_schema_are_checked_with_a_reason() -> None:
    s = _summary(_message())
    for bad, why in (
        (msgspec.structs.replace(s, seq_last=s.seq_first - 1), "seq_last"),
        (msgspec.structs.replace(s, exec_p90_us=s.exec_max_us + 1), "out of order"),
        (msgspec.structs.replace(s, peers=[Conn(peer=9, dir="send", bytes=1)]), "peer 9"),
        (msgspec.structs.replace(s, samples=s.count + 1), "samples"),
    ):
        with pytest.raises(EventDecodeError, match=why):
            decode_with_summaries(encode_summary_message([bad]))
        value, _ = encode_arrow_with_summaries([bad])
        with pytest.raises(EventDecodeError, match=why):
            decode_with_summaries(value, ARROW_CONTENT_TYPE)


def test_a_reader_that_knows_only_op_and_progress_refuses_the_message_with_a_reason() -> None:
    """What the worker before the summary kind does: its decoders (decode_message for
    JSON, the Arrow validation, and decode_block, the worker's batch decoder) refuse the
    whole message, naming the kind; the worker dead-letters it with that reason."""
    recs = _message()
    data = encode_summary_message(recs)
    with pytest.raises(EventDecodeError, match=r"Invalid value 'summary' - at `\$\[\d+\]\.kind`"):
        decode_message(data)
    value, headers = encode_arrow_with_summaries(recs)
    with pytest.raises(EventDecodeError, match=r"Invalid value 'summary' \(op or progress\)"):
        decode_events(value, headers[0][1])
    items, _ = decode_block([(data, None), (value, ARROW_CONTENT_TYPE)])
    assert all(isinstance(x, EventDecodeError) and "summary" in str(x) for x in items)


def test_the_summaries_give_the_slow_connection_matrix_the_raw_sums() -> None:
    """The per-peer totals, folded by the pipeline (the worker's fold): the matrix of a
    window of summaries equals the matrix of every raw collective, whatever the seqs of
    the samples (the detector's 1-in-2 sampling by seq applies to raw collectives, not
    to totals: a total with an odd-seq sample once lost its window's traffic), and the
    samples carry no connections of their own (counted in the totals)."""
    from streams.core import DetectionPipeline
    from streams.core.config import DetectConfig

    rng = np.random.default_rng(11)
    raw = [ev for rank in range(4) for ev in _ops(rank, 300, rng)]
    st = ExpandStats()
    p = DetectionPipeline(detect=DetectConfig(conn_sample_every=2))
    msgs = list(summarised([raw[i : i + 100] for i in range(0, len(raw), 100)], 16))
    for m in msgs:
        p.feed(expand(m, st), [r for r in m if isinstance(r, SummaryEvent)])
    p.feed([])  # nothing: the open slice stays open
    assert st.summaries == 12  # 3 windows x 4 ranks
    assert not any(e.conns for m in msgs for e in expand(m))
    p._flush("j", p.lanes["j"])  # observe the slice: its summaries are folded after it
    sc = next(d for d in p.detectors["0xc"].detectors if d.name == "slow_conn")
    want = DetectionPipeline(detect=DetectConfig(conn_sample_every=1))
    want.feed(raw)
    want._flush("j", want.lanes["j"])
    sc_raw = next(d for d in want.detectors["0xc"].detectors if d.name == "slow_conn")
    cells, ref = sc.matrix.cells, sc_raw.matrix.cells
    assert cells.keys() == ref.keys() and len(ref) == 12
    for key, (b, t) in ref.items():
        assert cells[key][0] == b and cells[key][1] == pytest.approx(t, rel=1e-9)
    assert sc.conn_bytes / sc.conn_n == pytest.approx(sc_raw.conn_bytes / sc_raw.conn_n)
    assert p.summary_evidence.folded_totals == 12
    assert ConnMatrix  # the detector that reads these sums (streams/core/slow_conn.py)


def test_a_window_without_a_sample_is_held_then_forced_out() -> None:
    rng = np.random.default_rng(5)
    ops = [e for e in _ops(0, 40, rng, seq0=0) if not is_sample(e.seq, 1000)]
    s = Summariser(k=1000, max_hold=3)
    for ev in ops[:20]:
        s.add(ev, ("file", 1))
    assert s.flush() == {} and s.held_marks() == [{"file": 1}]
    for ev in ops[20:]:
        s.add(ev, ("file", 2))
    assert s.flush() == {}
    (recs, marks), = s.flush().values()  # fmt: skip
    assert marks == {"file": 1} and _summary(recs).count == len(ops)
    st = ExpandStats()
    assert expand(recs, st) == [] and st.summaries == 1  # its totals: summary evidence


def test_a_summarised_trace_reads_back_as_its_expanded_events(tmp_path: Path) -> None:
    """``summarise_trace`` writes what exporters with summaries send; ``read_trace`` (what
    ``c4stream detect`` and replay read) gives each line's expanded events."""
    from producers.simulator import SimConfig, write_trace
    from producers.summary import summarise_trace
    from producers.traces import TraceLine, read_trace

    cfg = SimConfig(hosts=2, gpus_per_host=4, tp=4, duration_s=4, iteration_s=0.02, seed=1)
    raw = tmp_path / "raw.jsonl.gz"
    write_trace(cfg, raw)
    k, lines = summarise_trace(raw, tmp_path / "sum.jsonl.gz")
    raw_lines = [x for x in read_trace(raw) if isinstance(x, TraceLine)]
    ops = sum(e.__class__ is OpEvent for x in raw_lines for e in x.events)
    assert k == 1 << round(np.log2(ops / cfg.gpus / 4))  # about one sample per GPU-second
    got = list(read_trace(tmp_path / "sum.jsonl.gz"))
    assert len(got) == lines and all(isinstance(x, TraceLine) for x in got)
    events = [e for x in got for e in x.events]  # type: ignore[union-attr]
    assert not any(isinstance(e, SummaryEvent) for e in events)
    want = [
        e for recs in summarised([x.events for x in raw_lines], k, every=2) for e in expand(recs)
    ]
    assert events == want and len(events) < ops / 10
