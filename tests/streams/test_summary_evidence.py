"""Straggler evidence from summarised windows (issue 22, item 2): the late arriver's
kernel is the shortest, its peers' longer by the wait, read from each rank's kernel-time
summary aligned by seq range and weighed by the straggler rule as matched collectives."""

from __future__ import annotations

import pytest

from bench.bench_capacity import QUALITY_FAULTS, sim_config
from producers.simulator import simulate
from producers.summary import SummaryEvent, expand, summarised
from streams.core import CommDetector
from streams.core.config import DetectConfig
from streams.core.straggler import SeqAligner, judge_stragglers
from streams.core.summary_evidence import SummaryEvidence, SummaryRounds, SummaryStats, fold_round

CFG = DetectConfig()


def stats(rank: int, p50: float, spread: float, count: int = 400, seq0: int = 0) -> SummaryStats:
    lo, hi = p50 - spread, p50 + spread
    return SummaryStats(rank, count, seq0, seq0 + count - 1, p50 * count, lo,
                        p50, p50 + 0.8 * spread, hi)  # fmt: skip


def judge(a: SeqAligner) -> list[int]:
    found = judge_stragglers(
        a, CFG.straggler_min_seqs, CFG.straggler_last_frac, CFG.straggler_min_wait,
        CFG.straggler_min_z, 2, 2_000_000 / 400, CFG.straggler_min_share,
        CFG.straggler_confidence_z,
    )  # fmt: skip
    return [f.rank for f in found]


def test_a_round_where_one_rank_waited_for_nobody_names_it_and_a_healthy_one_nobody() -> None:
    # rank 2 arrives last: its kernels (~1 ms) are shorter than any peer's (~4 ms)
    late = [stats(r, 4000.0 + 30 * r, 300.0) for r in (0, 1, 3, 4, 5, 6, 7)]
    a = SeqAligner(8, 64)
    assert fold_round(a, late + [stats(2, 1000.0, 200.0)])
    assert a.n_last.tolist() == [0, 0, 400, 0, 0, 0, 0, 0]  # its max below every peer's min
    assert a.window_n_seqs == 400 and (a.window_seq_lo, a.window_seq_hi) == (0, 399)
    assert judge(a) == [2]
    # healthy: the ranks' times overlap (a percent apart): nobody proven last, no finding
    b = SeqAligner(8, 64)
    assert fold_round(b, [stats(r, 4000.0 + 10 * r, 300.0) for r in range(8)])
    assert b.n_last.sum() == 0 and judge(b) == []


def test_rounds_are_aligned_by_seq_range_and_need_enough_ranks() -> None:
    r = SummaryRounds(4)
    r.add([stats(0, 1.0, 0.1, seq0=0), stats(1, 1.0, 0.1, seq0=2)])
    r.add([stats(0, 1.0, 0.1, seq0=400)])  # rank 0 moved on: a round of 2 ranks, too few
    assert r.take() == []
    r.add([stats(q, 1.0, 0.1, seq0=400) for q in (1, 2, 3)])  # every rank: closed at once
    [rnd] = r.take()
    assert sorted(s.rank for s in rnd) == [0, 1, 2, 3]


def _findings(fault: str, k: int, evidence: bool) -> list[tuple[str, str, int | None]]:
    faults = [QUALITY_FAULTS[fault]] if fault else []
    sim = sim_config(1000, hosts=8, gpus_per_host=4, duration_s=20, faults=faults, seed=3)
    dets: dict[str, CommDetector] = {}
    ev = SummaryEvidence()
    out = []
    for m in summarised(simulate(sim), k, every=2):
        comm = m[0].comm
        d = dets.setdefault(comm, CommDetector(comm, CFG))
        events = expand(m)
        if events:
            out += d.observe(events)
        if evidence:
            ev.add(x for x in m if isinstance(x, SummaryEvent))
            ev.fold(comm, d)
    return [(v.fault, v.host, v.gpu) for v in out if not v.benign]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_at_1_in_1024_the_summaries_find_the_straggler_the_samples_alone_miss() -> None:
    """1,000 collectives/s/rank, ~4 records per GPU per second: ~2 matched samples per
    window are too few for the rule; the summaries of every collective are not."""
    assert _findings("straggler ×1.5", 1024, evidence=False) == []
    got = _findings("straggler ×1.5", 1024, evidence=True)
    assert got and set(got) == {("straggler", "node-003", 2)}, got
    # no straggler where there is none: a healthy job, and a slow NIC (everyone waits)
    assert not [f for f in _findings("", 1024, evidence=True) if f[0] == "straggler"]
    slow = _findings("slow_nic 0.4", 1024, evidence=True)
    assert not [f for f in slow if f[0] == "straggler"], slow


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_workers_router_takes_the_summaries_evidence_from_accepted_messages_only() -> None:
    """The worker's path (``CommRouter``, JSON with summaries) at 1 in 1024: the
    straggler is found, and a message refused at the edge adds no evidence."""
    from producers.summary import encode_summary_message
    from streams.app.deadletter import Record
    from streams.app.detect_runner import CommRouter
    from streams.app.engine import CoreEngine

    sim = sim_config(1000, hosts=8, gpus_per_host=4, duration_s=20,
                     faults=[QUALITY_FAULTS["straggler ×1.5"]], seed=3)  # fmt: skip
    r = CommRouter(CoreEngine(), lambda k: None, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=1_000_000)  # fmt: skip
    msgs = [encode_summary_message(m) for m in summarised(simulate(sim), 1024, every=2)]
    found = []
    for i in range(0, len(msgs), 32):
        recs = [Record("ev", 0, i + j, None, v) for j, v in enumerate(msgs[i : i + 32])]
        found += r.process(recs).verdicts
    found += r.close_slices().verdicts
    got = {(v.fault, v.host, v.gpu) for v in found if not v.benign}
    assert ("straggler", "node-003", 2) in got, got
    assert {g for g in got if g[0] == "straggler"} == {("straggler", "node-003", 2)}
    assert r.summary_evidence.folded > 0
    # a message the edge refuses (nranks changed: a forgery or a bug) adds nothing
    m = next(m for m in summarised(simulate(sim), 1024, every=2) if len(m) > 1)
    import msgspec

    forged = [msgspec.structs.replace(x, nranks=x.nranks + 1) for x in m]
    before = {c: (len(x._open), len(x._closed)) for c, x in r.summary_evidence.rounds.items()}
    out = r.process([Record("ev", 0, 10**6, None, encode_summary_message(forged))])
    assert [d.reason.split(":")[0] for d in out.deadletters] == ["event breaks the contract"]
    after = {c: (len(x._open), len(x._closed)) for c, x in r.summary_evidence.rounds.items()}
    assert after == before
