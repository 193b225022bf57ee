"""The shapes of real training on small hand-made traces: pipeline pairs judged against
their replicas, small communicators' cells against their family, the straggler's effect
size, windows counted in collectives, intermittent stragglers."""

from __future__ import annotations

import numpy as np
import pytest

from producers.events import Conn, OpEvent
from streams.core import CommDetector, DetectConfig, HostCorrelator, PolicyConfig
from streams.verdicts import Verdict

T0 = 1_750_000_000_000_000
W = 5_000_000


def _note(comm: str, host: str, window: int, evidence: dict, fault: str = "straggler") -> Verdict:
    return Verdict(id=f"{comm}{window}", ts_us=T0 + (window + 1) * W, job="j", comm=comm,
                   host=host, fault=fault, score=0.0, reason="note",
                   window_start_us=T0 + window * W, window_end_us=T0 + (window + 1) * W,
                   evidence=evidence, benign=True)  # fmt: skip


def _straggler(host: str, gpu: int, window: int, comm: str = "dp") -> Verdict:
    return Verdict(id=f"s{host}{gpu}{window}{comm}", ts_us=T0 + (window + 1) * W, job="j",
                   comm=comm, host=host, gpu=gpu, fault="straggler", score=0.9, reason="r",
                   window_start_us=T0 + window * W, window_end_us=T0 + (window + 1) * W,
                   evidence={"collectives": 20, "last_frac": 0.9, "peer_time_x": 3.0,
                             "late_ms": 20.0, "comm_hosts": 8, "nranks": 8,
                             "comm_name": f"dp-{comm}"})  # fmt: skip


def _pair(r: int, window: int, exec0: float, exec1: float) -> Verdict:
    """Replica ``r`` of a two-stage pipeline: a{r} GPU 0 sends to b{r} GPU 0."""
    ev = {"role": "pair", "hosts": [f"a{r}", f"b{r}"], "gpus": [0, 0],
          "exec_ms": [exec0, exec1], "collectives": 12, "period_ms": 400.0,
          "comm_hosts": 2, "nranks": 2, "comm_name": f"pp-{r}"}  # fmt: skip
    return _note(f"pp{r}", f"a{r}", window, ev)


def _feed(c: HostCorrelator, vs: list[Verdict]) -> list:
    out = []
    for v in sorted(vs, key=lambda v: (v.ts_us, not v.benign)):
        out += c.observe(v)
    return out


@pytest.mark.timeout(10)
def test_pipeline_bubbles_clear_nobody_a_straggler_behind_them_is_isolated() -> None:
    """Every receiving stage spends 60 ms per transfer waiting by schedule (the bubble);
    the straggler b2 is late in its data-parallel ring. The old rule let the bubble's
    waiting note clear it; now only waiting beyond the replicas does."""
    c = HostCorrelator(PolicyConfig())
    vs = []
    for w in (1, 2, 3):
        vs += [_pair(r, w, 5.0, 60.0 + r * 0.3) for r in range(6)]
        # the straggler detector's note about the bubble: nobody named as late here
        vs.append(_note("pp2", "b2", w, {"role": "waiting", "gpus": [0], "extra_ms": [55.0],
                                          "waited_for": [], "comm_hosts": 2}))  # fmt: skip
        vs.append(_straggler("b2", 0, w))
    cmds = _feed(c, vs)
    assert [(x.host, x.gpu, x.fault) for x in cmds] == [("b2", 0, "straggler")]


@pytest.mark.timeout(10)
def test_a_stage_waiting_for_its_late_neighbour_is_a_victim() -> None:
    """a3 is late: b3, the next stage, waits 40 ms more per transfer than the receiving
    stage of the other replicas, and is then late in its own ring. b3 is cleared; the
    command for a3 says its neighbour waited for its stage."""
    c = HostCorrelator(PolicyConfig())
    vs = []
    for w in (1, 2, 3):
        vs += [_pair(r, w, 1.0 if r == 3 else 5.0, 100.0 if r == 3 else 60.0 + r * 0.3)
               for r in range(6)]  # fmt: skip
        vs.append(_straggler("b3", 0, w, comm="dp-b"))
        vs.append(_straggler("a3", 0, w, comm="dp-a"))
    cmds = _feed(c, vs)
    assert [(x.host, x.gpu) for x in cmds] == [("a3", 0)]
    assert "b3 GPU 0 spent 39.1 ms more per transfer" in cmds[0].reason
    assert "pipeline stage is the one its neighbours wait for" in cmds[0].reason


def _cells(comm: str, window: int, cells: list[tuple[str, str, float]], p2p: bool = True,
           nranks: int = 2) -> Verdict:  # fmt: skip
    ev = {"role": "cells", "src": [i % 2 for i in range(len(cells))],
          "dst": [1 - i % 2 for i in range(len(cells))],
          "src_host": [a for a, _, _ in cells], "src_nic": ["mlx5_0"] * len(cells),
          "dst_host": [b for _, b, _ in cells], "dst_nic": ["mlx5_0"] * len(cells),
          "gbs": [g for _, _, g in cells], "size_log2": 26, "p2p": p2p,
          "comm_hosts": 2, "nranks": nranks, "comm_name": comm}  # fmt: skip
    return _note(comm, cells[0][0], window, ev, fault="slow_link")


@pytest.mark.timeout(10)
def test_a_one_way_slow_pipeline_link_is_named() -> None:
    c = HostCorrelator(PolicyConfig())
    vs = []
    for w in (1, 2):
        for r in range(6):
            fwd = 10.0 if r == 4 else 24.8 + 0.01 * r
            vs.append(_cells(f"pp{r}", w, [(f"a{r}", f"b{r}", fwd), (f"b{r}", f"a{r}", 24.9)]))
    cmds = _feed(c, vs)
    assert [(x.host, x.nic, x.peer_host, x.fault) for x in cmds] == [
        ("a4", "mlx5_0", "b4", "slow_link")
    ]
    assert cmds[0].reason.startswith("link a4 mlx5_0 -> b4 is slow: it moved 40% of the median")


@pytest.mark.timeout(10)
def test_both_ways_slow_with_nothing_to_tell_the_ends_apart_isolates_neither() -> None:
    c = HostCorrelator(PolicyConfig())
    vs = []
    for w in (1, 2, 3, 4):
        for r in range(6):
            g = 12.0 if r == 4 else 25.0
            vs.append(_cells(f"pp{r}", w, [(f"a{r}", f"b{r}", g), (f"b{r}", f"a{r}", g)]))
    assert _feed(c, vs) == []


@pytest.mark.timeout(10)
def test_a_nic_slow_with_two_remote_nics_is_the_nic_not_its_neighbours() -> None:
    """Three-stage pipelines: m2 (the middle stage of replica 2) has a slow NIC, so both
    its pairs are slow both ways; the NIC is named, not the stages beside it."""
    c = HostCorrelator(PolicyConfig())
    vs = []
    for w in (1, 2):
        for r in range(6):
            g = 12.5 if r == 2 else 25.0 - 0.01 * r
            vs.append(_cells(f"pa{r}", w, [(f"f{r}", f"m{r}", g), (f"m{r}", f"f{r}", g)]))
            vs.append(_cells(f"pb{r}", w, [(f"m{r}", f"l{r}", g), (f"l{r}", f"m{r}", g)]))
    cmds = _feed(c, vs)
    assert [(x.host, x.nic, x.fault) for x in cmds] == [("m2", "mlx5_0", "slow_nic")]


def _tp_trace(det: CommDetector, late: dict[int, float], seconds: int = 16,
              per_s: int = 4) -> list:  # fmt: skip
    """An 8-rank communicator inside one host; rank r arrives ``late[r]`` of the step
    (as a fraction of the 250 ms between collectives) after the others."""
    rng = np.random.default_rng(7)
    out, seq, step = [], 0, 1e6 / per_s
    for sec in range(seconds):
        batch = []
        for k in range(per_s):
            ts = T0 + sec * 1_000_000 + int(k * step)
            lat = np.array([late.get(r, 0.0) * step for r in range(8)])
            x = 3_000 + rng.normal(0, 60, 8) + lat.max() - lat
            batch += [OpEvent(v=1, job="j", comm="tp", comm_name="tp-node-000", nranks=8,
                              rank=r, host="node-000", gpu=r, ts_us=ts, op="AllReduce",
                              seq=seq, bytes=1 << 20, exec_us=float(x[r]))
                      for r in range(8)]  # fmt: skip
            seq += 1
        out += det.observe(batch)
    return out + det.advance(T0 + (seconds + 1) * 1_000_000)


@pytest.mark.timeout(10)
def test_a_static_spread_of_a_percent_is_never_a_straggler_five_percent_is() -> None:
    """A GPU 0.75 % of the step behind its peers is last in every collective and its
    peers' kernel time doubles (the kernels are short): the old chance-level rule named
    it. The wait it causes is under the 2 % bar: nothing. At 5 % it is a straggler."""
    cfg = DetectConfig(warmup_us=0)
    spread = [v for v in _tp_trace(CommDetector("tp", cfg), {5: 0.0075, 2: 0.004})
              if not v.benign]  # fmt: skip
    assert spread == []
    found = [v for v in _tp_trace(CommDetector("tp", cfg), {5: 0.05}) if not v.benign]
    assert {(v.fault, v.gpu) for v in found} == {("straggler", 5)}
    assert all(v.evidence["step_share"] >= 0.02 for v in found)
    assert "of the step or more" in found[0].reason


def _slow_steps(det: CommDetector, step_us: int, steps: int) -> list[Verdict]:
    """Four ranks on four hosts, one collective per step; rank 2 computes 2.3x longer,
    so its peers wait about 6 % of the step for it."""
    out = []
    for s in range(steps):
        ts = T0 + s * step_us
        x = [0.07 * step_us] * 4
        x[2] = 0.01 * step_us
        out += det.observe([OpEvent(v=1, job="j", comm="rs", comm_name="dp-rs", nranks=4,
                                    rank=r, host=f"node-{r:03d}", gpu=0, ts_us=ts + r,
                                    op="ReduceScatter", seq=s, bytes=1 << 24,
                                    exec_us=float(x[r])) for r in range(4)])  # fmt: skip
    return out


@pytest.mark.timeout(20)
def test_windows_are_counted_in_collectives_for_long_and_short_steps() -> None:
    """One collective per 46-s step: a window closes after five of them (not after 5 s
    with one), so the straggler is found over a few steps; 500 collectives per second
    close a window after 256, well inside 5 s."""
    got = [v for v in _slow_steps(CommDetector("rs", DetectConfig(warmup_us=0)), 46_000_000,
                                  16) if not v.benign]  # fmt: skip
    assert got and {(v.fault, v.host) for v in got} == {("straggler", "node-002")}
    first = got[0]
    span = first.window_end_us - first.window_start_us
    assert 4 * 46_000_000 <= span <= 6 * 46_000_000
    assert first.evidence["collectives"] >= 5
    fast = [v for v in _slow_steps(CommDetector("rs", DetectConfig(warmup_us=0)), 2_000, 3_000)
            if not v.benign]  # fmt: skip
    assert fast and fast[0].window_end_us - fast[0].window_start_us < 1_000_000


@pytest.mark.timeout(20)
def test_a_gpu_slow_on_a_third_of_steps_is_found_as_intermittent() -> None:
    """Rank 6 is 50 % of the step late in one collective in three, never late otherwise:
    no single window makes it persistently last; the decayed evidence of the last
    windows does, with its own reason."""
    det = CommDetector("tp", DetectConfig(warmup_us=0))
    rng = np.random.default_rng(3)
    out, seq = [], 0
    for sec in range(40):
        batch = []
        for k in range(4):
            late = 0.5 * 250_000 if rng.random() < 0.33 else 0.0
            x = 3_000 + rng.normal(0, 60, 8)
            x[np.arange(8) != 6] += late
            batch += [OpEvent(v=1, job="j", comm="tp", comm_name="tp-node-000", nranks=8,
                              rank=r, host="node-000", gpu=r,
                              ts_us=T0 + sec * 1_000_000 + k * 250_000, op="AllReduce",
                              seq=seq, bytes=1 << 20, exec_us=float(x[r]))
                      for r in range(8)]  # fmt: skip
            seq += 1
        out += det.observe(batch)
    found = [v for v in out if not v.benign]
    assert found and {(v.fault, v.gpu) for v in found} == {("straggler", 6)}
    inter = [v for v in found if v.evidence["intermittent"]]
    assert inter and "is intermittently late" in inter[0].reason
    cmds = _feed(HostCorrelator(PolicyConfig()), out)
    assert [(x.gpu, x.fault) for x in cmds] == [(6, "straggler")]
    assert "is intermittently late" in cmds[0].reason


def _pp_op(rank: int, seq: int, ts: int, exec_us: float, nbytes: int, time_us: float,
           comm: str, hosts: tuple[str, str]) -> OpEvent:  # fmt: skip
    send = (seq % 2 == 0) == (rank == 0)  # forward on even collectives, backward on odd
    conn = Conn(peer=1 - rank, dir="send" if send else "recv", bytes=nbytes, time_us=time_us)
    return OpEvent(v=1, job="j", comm=comm, comm_name=comm, nranks=2, rank=rank,
                   host=hosts[rank], gpu=0, nic="mlx5_0", ts_us=ts,
                   op="Send" if send else "Recv", seq=seq, bytes=nbytes, exec_us=exec_us,
                   conns=[conn])  # fmt: skip


@pytest.mark.timeout(20)
def test_a_pipeline_pair_sends_its_ends_and_cells_for_its_replicas() -> None:
    """A Send/Recv pair cannot judge itself: its detectors say what each end spent and
    what each direction moved, in notes (both directions: it is not sampled by seq)."""
    det = CommDetector("pp0", DetectConfig(warmup_us=0))
    out = []
    for s in range(60):
        ts = T0 + s * 200_000
        out += det.observe([_pp_op(r, s, ts, 5_000.0 if r == 0 else 40_000.0, 1 << 26,
                                   2_700.0, "pp0", ("a0", "b0")) for r in (0, 1)])  # fmt: skip
    out += det.advance(T0 + 13_000_000)
    roles = {v.evidence.get("role") for v in out if v.benign}
    assert {"pair", "cells"} <= roles and not [v for v in out if not v.benign]
    pair = next(v for v in out if v.evidence.get("role") == "pair")
    assert pair.evidence["exec_ms"] == [5.0, 40.0] and pair.evidence["hosts"] == ["a0", "b0"]
    cells = next(v for v in out if v.evidence.get("role") == "cells")
    cells_at = zip(cells.evidence["src_host"], cells.evidence["dst_host"], strict=True)
    assert sorted(cells_at) == [
        ("a0", "b0"), ("b0", "a0")
    ]  # fmt: skip
    assert cells.evidence["p2p"] is True


@pytest.mark.timeout(10)
def test_the_hang_threshold_covers_a_rare_long_normal_wait_and_forgets_a_one_off() -> None:
    """A pipeline pair waits a whole bubble (3 s) once a step, among many short
    transfers: 4x its p90 would call that a hang; 1.5x the recent peak does not. The
    peak decays in time and in collectives, whichever is slower: a checkpoint's one
    long collective is forgotten within minutes of collectives, while a wait that
    recurs once a step is remembered over steps, however long they are."""
    from streams.core.stats import NormalModel

    m = NormalModel()
    for k in range(200):
        m.learn_ops(np.array([5_000.0] * 9 + [3_000_000.0 if k % 10 == 0 else 5_000.0]))
        m.learn_periods(np.array([20_000.0] * 10))
        m.note_peak(3_000_000.0 if k % 10 == 0 else 5_000.0, T0 + k * 100_000)
    assert m.hang_threshold_us(2_500_000, 4.0) > 1.4 * 3_000_000  # the bubble, with margin
    m.note_peak(5_000.0, T0 + 20_000_000 + 600_000_000)  # ten minutes of silence
    assert m.hang_threshold_us(2_500_000, 4.0) > 1.4 * 3_000_000  # no collective: kept
    for k in range(300):  # then ten minutes of short collectives (3,000 kernel times)
        m.learn_ops(np.array([5_000.0] * 10))
        m.note_peak(5_000.0, T0 + 620_000_000 + k * 2_000_000)
    assert m.hang_threshold_us(2_500_000, 4.0) == 2_500_000


def test_the_recent_peak_spans_long_steps() -> None:
    """One bubble per 60-s step, 16 transfers per step: after one step without it the
    threshold still covers it (decaying by time alone, e per minute, it would not)."""
    from streams.core.stats import NormalModel

    m = NormalModel()
    t = T0
    for _step in range(3):
        for k in range(16):
            big = k == 0
            m.learn_ops(np.array([20_000_000.0 if big else 500_000.0] * 2))
            m.learn_periods(np.array([3_750_000.0] * 2))
            m.note_peak(20_000_000.0 if big else 500_000.0, t)
            t += 3_750_000
    assert m.hang_threshold_us(2_500_000, 4.0) >= 1.4 * 20_000_000


@pytest.mark.timeout(10)
def test_the_warm_up_waits_for_the_first_collectives_of_a_slow_communicator() -> None:
    det = CommDetector("rs", DetectConfig(warmup_us=5_000_000))
    _slow_steps(det, 46_000_000, 1)
    det.advance(T0 + 10_000_000)
    assert not det.view.warm()  # 10 s and one collective: its normal is not learned
    _slow_steps(det, 46_000_000, 6)
    assert det.view.warm()


def test_a_posted_send_holds_nobody_up_a_waiting_recv_does() -> None:
    """In a pipeline pair the sender of collective 8 waits in its Send while the
    receiver, busy with another microbatch, has not posted its Recv: nobody is blocked,
    no hang. The same counters with the waiting rank in a Recv: the sender is behind."""
    from streams.core.hang import judge_hang
    from streams.core.ranks import RankTable

    t = RankTable(2)
    t.started[:] = [8, 7]
    t.completed[:] = [7, 7]
    t.inflight_us[:] = [9e6, 0]
    t.prog_recv[:] = 100
    t.last_recv[:] = 100
    kw = dict(now=100, thr_us=2e6, silent_us=3_000_000, min_waiting_frac=0.5,
              max_culprit_frac=0.5)  # fmt: skip
    assert judge_hang(t, sending=np.array([True, False]), **kw) is None
    f = judge_hang(t, sending=np.array([False, False]), **kw)
    assert f is not None and f.kind == "noncomm" and f.culprits.tolist() == [1]
    # both posted and nothing moves: a communication hang, the sender included
    t.started[:] = [8, 8]
    t.inflight_us[:] = [9e6, 9e6]
    f = judge_hang(t, sending=np.array([True, False]), **kw)
    assert f is not None and f.kind == "comm"


def test_a_pair_is_judged_against_replica_notes_that_come_later() -> None:
    """Windows close by collectives, so the replicas' notes of the same time carry
    window starts of their own and may come after the first look: a first look with
    too few replicas must not stick."""
    from streams.core.family import Families
    from streams.core.findings import PairWait

    f = Families()
    t0 = 1_000_000_000

    def note(r: int, exec0: float) -> None:
        f.observe_pair("j", f"pp{r}", t0 + 5_000_000 + r * 1_000, t0 + r * 7_000,
                       PairWait(hosts=[f"a{r}", f"b{r}"], gpus=[0, 0], exec_ms=[exec0, 4.0],
                                period_ms=20.0))  # fmt: skip

    note(0, 9.0)  # 5 ms more per transfer than its replicas
    assert f.waited("j", "a0", 0, t0 + 5_000_000) == []  # nobody to compare with yet
    for r in range(1, 6):
        note(r, 4.0 + 0.01 * r)
    got = f.waited("j", "a0", 0, t0 + 5_000_000)
    assert [w.peer_host for w in got] == ["b0"]


@pytest.mark.timeout(10)
def test_a_gpu_whose_pipeline_link_is_slow_is_its_victim_not_a_straggler() -> None:
    """The link a4 -> b4 of replica 4 moves 40 % of its replicas': b4 GPU 0 gets its
    microbatches late, starts its next one late and arrives last in its own
    data-parallel ring. The link is isolated; b4 is the link's victim (its pair runs
    through a component found slow), not a straggler."""
    c = HostCorrelator(PolicyConfig())
    vs = []
    for w in (1, 2, 3):
        vs += [_pair(r, w, 5.0, 60.0 + r * 0.3) for r in range(6)]  # ends as their replicas
        for r in range(6):
            fwd = 10.0 if r == 4 else 24.8 + 0.01 * r
            vs.append(_cells(f"pp{r}", w, [(f"a{r}", f"b{r}", fwd), (f"b{r}", f"a{r}", 24.9)]))
        vs.append(_straggler("b4", 0, w))
    cmds = _feed(c, vs)
    assert [(x.host, x.fault) for x in cmds] == [("a4", "slow_link")]
    # the same straggler evidence beside a healthy link is isolated (the rule, not the
    # evidence, cleared it)
    healthy = [v for v in vs if not (v.comm == "pp4" and v.evidence.get("role") == "cells")]
    cmds = _feed(HostCorrelator(PolicyConfig()), healthy)
    assert [(x.host, x.gpu, x.fault) for x in cmds] == [("b4", 0, "straggler")]


def _late(window: int, last_frac: float, collectives: int, intermittent: bool) -> Verdict:
    v = _straggler("n1", 5, window)
    ev = {**v.evidence, "last_frac": last_frac, "collectives": collectives,
          "intermittent": intermittent, "step_share": 0.03}  # fmt: skip
    return Verdict(**{**{f: getattr(v, f) for f in v.__struct_fields__}, "evidence": ev,
                      "id": f"{v.id}{intermittent}"})  # fmt: skip


@pytest.mark.timeout(10)
def test_a_gpu_late_on_a_minority_of_steps_reads_intermittent_whichever_rule_fired() -> None:
    """At 0.1-s steps a run of slow steps fills a window (the per-window rule fires,
    last in 65 % of it) beside the decayed evidence (last in 30 % of 800): over its
    evidence it arrived last in a minority of collectives, so the reason says
    intermittent. A GPU last in 90 % of every window is a plain straggler."""
    [cmd] = _feed(HostCorrelator(PolicyConfig()),
                  [_late(1, 0.65, 100, False), _late(2, 0.3, 800, True)])  # fmt: skip
    assert "n1 GPU 5 is intermittently late: it arrived last in 34% of 900" in cmd.reason
    [cmd] = _feed(HostCorrelator(PolicyConfig()),
                  [_late(1, 0.9, 100, False), _late(2, 0.9, 100, False)])  # fmt: skip
    assert "n1 GPU 5 is a straggler: it arrived last in 90% of 200" in cmd.reason
