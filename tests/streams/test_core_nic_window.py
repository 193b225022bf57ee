"""A NIC slow in its own right is isolated on one window; congestion needs two.

The physics: a NIC whose every connection is slow, both ways (what it sends and what it
receives), with two or more peers, while nothing else is slow beside it, is slow
itself. Congestion is a queue at a shared switch port, in one direction (an
oversubscribed uplink, incast into one receiver), and it slows the other NICs'
connections through that port too: other cells, or one direction only. One window of
that must not isolate; a degrading NIC must not wait for a second window."""

from __future__ import annotations

import numpy as np
import pytest

from producers.events import Conn, OpEvent
from streams.core import CommDetector, DetectConfig, HostCorrelator, PolicyConfig
from streams.core.slow_conn import ConnMatrix
from streams.verdicts import Verdict

T0 = 1_750_000_000_000_000
W = 5_000_000
HOSTS = np.arange(8)


def _ring(m: ConnMatrix, slow: dict[tuple[int, int], float], n: int = 8) -> None:
    for s in range(n):
        m.add(s, (s + 1) % n, 1000, 100.0 / slow.get((s, (s + 1) % n), 1.0))


def test_a_nic_slow_both_ways_and_alone_is_whole() -> None:
    m = ConnMatrix()
    _ring(m, {(3, 4): 0.5, (4, 5): 0.5})
    [f] = m.judge(HOSTS, 0.75, 3)
    assert (f.kind, f.rank, f.whole) == ("nic", 4, True)


def test_a_nic_beside_another_slow_cell_is_not_whole() -> None:
    """Something else in the matrix is slow at the same time (a shared element)."""
    m = ConnMatrix()
    _ring(m, {(3, 4): 0.5, (4, 5): 0.5, (0, 1): 0.5}, n=12)
    got = {(f.kind, f.rank, f.whole) for f in m.judge(np.arange(12), 0.75, 3)}
    assert got == {("nic", 4, False), ("link", 0, False)}


def test_incast_into_one_receiver_is_a_nic_but_not_whole() -> None:
    """All-to-all of six ranks: everything into rank 2 slow (a queue at its switch
    port, one way), what it sends is fine."""
    m = ConnMatrix()
    for s in range(6):
        for d in range(6):
            if s != d:
                m.add(s, d, 1000, 250.0 if d == 2 else 100.0)
    [f] = m.judge(np.arange(6), 0.75, 3)
    assert (f.kind, f.rank, f.whole) == ("nic", 2, False)


def _ring_ops(seq: int, ts: int, frac: dict[int, float]) -> list[OpEvent]:
    """One ring collective of 8 hosts; the NIC of rank r keeps ``frac[r]`` of its speed
    (both the cell into it and the cell out of it)."""
    out = []
    for r in range(8):
        nxt, prv = (r + 1) % 8, (r - 1) % 8
        t_send = 100.0 / min(frac.get(r, 1.0), frac.get(nxt, 1.0))
        t_recv = 100.0 / min(frac.get(r, 1.0), frac.get(prv, 1.0))
        conns = [Conn(peer=nxt, dir="send", bytes=10_000, time_us=t_send),
                 Conn(peer=prv, dir="recv", bytes=10_000, time_us=t_recv)]  # fmt: skip
        out.append(OpEvent(v=1, job="j", comm="c1", comm_name="dp-rail0", nranks=8, rank=r,
                           host=f"node-{r:03d}", gpu=0, nic="mlx5_0", ts_us=ts,
                           op="AllReduce", seq=seq, bytes=1 << 20, exec_us=20_000.0,
                           conns=conns))  # fmt: skip
    return out


def _run(frac_at, seconds: int = 80) -> list:  # noqa: ANN001
    """Four collectives a second for ``seconds``; ``frac_at(t_s)`` -> {rank: speed}."""
    det = CommDetector("c1", DetectConfig(warmup_us=0))
    out, seq = [], 0
    for tenth in range(seconds * 4):
        t = tenth / 4
        out += det.observe(_ring_ops(seq, T0 + int(t * 1e6), frac_at(t)))
        seq += 1
    out += det.advance(T0 + (seconds + 1) * 1_000_000)
    c = HostCorrelator(PolicyConfig())
    cmds = []
    for v in sorted(out, key=lambda v: v.ts_us):
        cmds += c.observe(v)
    return cmds


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "ramp_from_s",
    [3, 6, 7.4],
    ids=["crossing-at-a-window-s-start", "crossing-late-in-a-window", "crossing-at-its-end"],
)
def test_a_degrading_nic_is_isolated_within_one_window_of_crossing(ramp_from_s: float) -> None:
    """Rank 4's NIC goes from full speed to 0.4 over 90 s. From 3 s it crosses 0.75 at
    40.5 s: the window 40-45 s so far, at its half (42.5 s), is under the bar and the
    command comes then, not at the window's end. From 6 s it crosses at 43.5 s, in the
    second half of that window, whose mean (its middle, 42.5 s) is 0.757, above the bar;
    its end is under it: the trend of the window's parts, read at its end, isolates it
    there (1.5 s after crossing), not at the end of the next window (6.5 s after). From
    7.4 s it crosses at 44.9 s, too late for that window's end to show it: the next
    window at its half does (47.5 s), not its end (50 s, a whole window after)."""
    crossing = ramp_from_s + 90 * 0.25 / 0.6

    def frac(t: float) -> dict[int, float]:
        return {4: 1.0 - 0.6 * min(1.0, max(0.0, (t - ramp_from_s) / 90))}

    cmds = _run(frac)
    assert [(x.host, x.nic, x.fault) for x in cmds] == [("node-004", "mlx5_0", "slow_nic")]
    late_s = (cmds[0].ts_us - T0) / 1e6 - crossing
    assert 0 <= late_s <= 0.65 * W / 1e6  # half a window, and the tick that saw its half
    assert cmds[0].evidence["windows"] == 1


@pytest.mark.timeout(20)
def test_one_collective_caught_by_a_passing_queue_isolates_nothing_at_a_window_s_half() -> None:
    """A queue passing through the fabric at 42 s slows the one collective whose
    transfers it catches on rank 4's NIC, both ways, to a third: of the five collectives
    with connection figures in the first half of the window 40-45 s, that one pulls the
    mean of rank 4's cells to 0.71 of the median. The half-window look reads each cell at
    the median of its collectives (the other four: full speed): nothing."""

    def frac(t: float) -> dict[int, float]:
        return {4: 1 / 3} if t == 42.0 else {}

    assert _run(frac) == []


def test_a_cell_at_the_median_of_its_parts() -> None:
    """Three collectives at full speed and one at a third: the median of the four parts
    is full speed, where the mean is 0.67 of it."""
    m = ConnMatrix()
    for q, speed in enumerate([1.0, 1.0, 1 / 3, 1.0]):
        m.add(0, 1, 1000, 10.0 / speed, seq=q)
    s, d, med = m.median_cells(np.arange(2))
    assert (s.tolist(), d.tolist(), med.tolist()) == ([0], [1], [100.0])
    assert m.inter_cells(np.arange(2))[2].tolist() == [pytest.approx(4000 / 60)]


@pytest.mark.timeout(20)
def test_the_end_of_a_window_of_noisy_healthy_nics_isolates_nothing() -> None:
    """Every connection jitters ±10 % from one collective to the next: a line through
    a window's parts falls in about half the windows, by its noise; no NIC has all of
    its connections, both ways, under 0.75 of the median at the end."""
    rng = np.random.default_rng(7)
    noise = rng.uniform(0.9, 1.1, size=(80 * 4 + 1, 8))
    state = {"i": 0}

    def frac(t: float) -> dict[int, float]:
        state["i"] += 1
        return dict(enumerate(noise[state["i"]].tolist()))

    assert _run(frac) == []


def test_the_end_of_a_window_is_the_trend_of_its_parts() -> None:
    """A cell falling steadily from 1 to 0.8 of its speed over the window is read at
    0.8 at the end; a flat or rising one at its mean; totals (no collectives' order)
    are one part, read at their mean."""
    m = ConnMatrix()
    for q in range(64):
        m.add(0, 1, 1000, 10.0 / (1.0 - 0.2 * (q + 1) / 64), seq=1000 + q)
        m.add(1, 0, 1000, 10.0 / (0.8 + 0.2 * (q + 1) / 64), seq=1000 + q)
    s, d, end = m.end_cells(np.arange(2))
    cells = list(zip(s.tolist(), d.tolist(), strict=True))
    mean = dict(zip(cells, m.inter_cells(np.arange(2))[2].tolist(), strict=True))
    got = dict(zip(cells, end.tolist(), strict=True))
    assert got[(0, 1)] == pytest.approx(80.0, rel=0.02) and mean[(0, 1)] > 88
    assert got[(1, 0)] == mean[(1, 0)]
    t = ConnMatrix()
    t.add_many(np.array([0]), np.array([1]), np.array([1000.0]), np.array([20.0]))
    assert t.end_cells(np.arange(2))[2].tolist() == [50.0]


@pytest.mark.timeout(10)
def test_pipeline_pairs_through_a_nic_under_the_bar_at_the_window_s_end_isolate_it() -> None:
    """m2's cells both ways average 0.8 of their families this window (above the bar)
    and end it at 0.68: whole at the end, nothing else slow: one window. Under the bar
    at the end in what m2 receives only (a queue into its port): nothing."""
    mean = {("f2", "m2"): 20.0, ("m2", "f2"): 20.0, ("m2", "l2"): 20.0, ("l2", "m2"): 20.0}
    end = {k: 17.0 for k in mean}
    assert _feed(_pipelines(1, mean)) == []
    cmds = _feed(_pipelines(1, mean, end))
    assert [(x.host, x.fault, x.evidence["windows"]) for x in cmds] == [("m2", "slow_nic", 1)]
    into = {k: v for k, v in end.items() if k[1] == "m2"}
    assert _feed(_pipelines(1, mean, into)) == []


@pytest.mark.timeout(20)
def test_one_window_of_congestion_at_a_shared_port_isolates_nothing() -> None:
    """For one window (20-25 s) a queue at a leaf's uplink halves what crosses it: the
    hosts 3 and 4 behind it (cells 2->3 in, 4->5 out, and 3->4 inside the leaf is
    fine). Two NICs' cells, one window: nothing is isolated."""

    def frac(t: float) -> dict[int, float]:
        return {3: 0.5, 5: 0.5} if 20 <= t < 25 else {}

    assert _run(frac, seconds=40) == []


def _nic_verdict(window: int, whole: bool, host: str = "node-004") -> Verdict:
    return Verdict(id=f"n{window}{whole}", ts_us=(window + 1) * W, job="j", comm="c1",
                   host=host, gpu=0, nic="mlx5_0", fault="slow_nic", score=0.7, reason="r",
                   window_start_us=window * W, window_end_us=(window + 1) * W,
                   evidence={"throughput_ratio": 0.74, "cells": 2, "median_gbs": 10.0,
                             "whole_nic": whole, "comm_hosts": 8, "comm_name": "dp"})  # fmt: skip


def test_the_correlator_takes_one_window_of_a_whole_nic_two_of_anything_else() -> None:
    c = HostCorrelator(PolicyConfig())
    assert c.observe(_nic_verdict(1, whole=False)) == []
    assert len(c.observe(_nic_verdict(2, whole=False))) == 1
    c = HostCorrelator(PolicyConfig())
    [cmd] = c.observe(_nic_verdict(1, whole=True))
    assert (cmd.host, cmd.nic, cmd.ts_us, cmd.evidence["windows"]) == ("node-004", "mlx5_0",
                                                                      2 * W, 1)  # fmt: skip


def _cells(comm: str, window: int, cells: list[tuple[str, str, float]],
           ends: list[float] | None = None) -> Verdict:  # fmt: skip
    ev = {"gbs_end": ends or [],"role": "cells", "src": [i % 2 for i in range(len(cells))],
          "dst": [1 - i % 2 for i in range(len(cells))],
          "src_host": [a for a, _, _ in cells], "src_nic": ["mlx5_0"] * len(cells),
          "dst_host": [b for _, b, _ in cells], "dst_nic": ["mlx5_0"] * len(cells),
          "gbs": [g for _, _, g in cells], "size_log2": 26, "p2p": True,
          "comm_hosts": 2, "nranks": 2, "comm_name": comm}  # fmt: skip
    return Verdict(id=f"{comm}{window}", ts_us=T0 + (window + 1) * W, job="j", comm=comm,
                   host=cells[0][0], fault="slow_link", score=0.0, reason="note",
                   window_start_us=T0 + window * W, window_end_us=T0 + (window + 1) * W,
                   evidence=ev, benign=True)  # fmt: skip


def _pipelines(window: int, slow: dict[tuple[str, str], float],
               at_end: dict[tuple[str, str], float] | None = None) -> list[Verdict]:  # fmt: skip
    """Six replicas of a three-stage pipeline f -> m -> l (both ways per pair);
    ``at_end``: cells whose throughput at the window's end differs from their mean."""
    out, at_end = [], at_end or {}
    for r in range(6):
        for a, b in ((f"f{r}", f"m{r}"), (f"m{r}", f"l{r}")):
            fwd, bwd = slow.get((a, b), 25.0 - 0.01 * r), slow.get((b, a), 25.0 - 0.01 * r)
            ends = [at_end.get((a, b), fwd), at_end.get((b, a), bwd)]
            out.append(_cells(f"p{a}{b}", window, [(a, b, fwd), (b, a, bwd)], ends))
    return out


def _feed(vs: list[Verdict]) -> list:
    c = HostCorrelator(PolicyConfig())
    return [cmd for v in vs for cmd in c.observe(v)]


@pytest.mark.timeout(10)
def test_pipeline_pairs_through_a_nic_slow_both_ways_isolate_it_in_one_window() -> None:
    m2 = {("f2", "m2"): 12.0, ("m2", "f2"): 12.0, ("m2", "l2"): 12.0, ("l2", "m2"): 12.0}
    cmds = _feed(_pipelines(1, m2))
    assert [(x.host, x.fault, x.evidence["windows"]) for x in cmds] == [("m2", "slow_nic", 1)]


@pytest.mark.timeout(10)
def test_pipeline_pairs_slow_into_a_nic_only_wait_for_a_second_window() -> None:
    """Only what m2 receives is slow (a queue into its port): one window is not enough."""
    into = {("f2", "m2"): 12.0, ("l2", "m2"): 12.0}
    assert _feed(_pipelines(1, into)) == []
    cmds = _feed(_pipelines(1, into) + _pipelines(2, into))
    assert [(x.host, x.fault, x.evidence["windows"]) for x in cmds] == [("m2", "slow_nic", 2)]
