"""The microbatched shapes of the simulator: pipelines (1F1B, interleaved), ZeRO/FSDP,
expert all-to-all, long steps, rates, and the faults on them.

Every test reads, from the events themselves, who waited for whom, and checks it
against the physics of the schedule (not against what a detector makes of it). Traces
are small (2 GPUs per host, at most 16 hosts, a few seconds) so the module stays fast.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import msgspec
import numpy as np
import pytest

from producers.events import OpEvent, ProgressEvent, encode_message
from producers.simulator import (
    EPOCH_US,
    SCENARIOS,
    BenignSpec,
    FaultSpec,
    SimConfig,
    SimConfigError,
    Simulation,
    ground_truth,
    simulate,
    validate,
)
from producers.simulator.config import collectives_per_step, with_step
from producers.simulator.pipeline import measure_step_s, with_rate
from producers.simulator.schedule import one_f_one_b, transfers_of

pytestmark = pytest.mark.timeout(90)

R = msgspec.structs.replace

#: 8 hosts x 2 GPUs, TP 2, a 4-stage 1F1B pipeline (2 hosts per stage), no noise, small
#: messages: every wait in the trace is the schedule's (or an injected fault's).
BASE = SimConfig(
    job="shape", hosts=8, gpus_per_host=2, tp=2, pp=4, schedule="1f1b", microbatches=8,
    layers=2, dp_mode="zero", dp_buckets=1, iteration_s=0.4, compute_jitter=0.0,
    link_jitter=0.0, tp_bytes=1 << 16, pp_bytes=1 << 16, dp_bytes=1 << 20, clock_skew_ms=0,
    duration_s=10,
)  # fmt: skip


def us(seconds: float) -> int:
    return EPOCH_US + int(seconds * 1e6)


def events(cfg: SimConfig) -> list:
    return [e for b in simulate(cfg) for e in b]


def ops(evs, prefix: str = "", op: str | None = None) -> list[OpEvent]:
    return [
        e
        for e in evs
        if isinstance(e, OpEvent) and e.comm_name.startswith(prefix) and (op is None or e.op == op)
    ]


def stage_of(host: str, cfg: SimConfig) -> int:
    return int(host.split("-")[1]) // cfg.hosts_per_stage


def wait_us(e: OpEvent) -> float:
    """Kernel time beyond moving the bytes: the wait for the other side."""
    return e.exec_us - max(c.time_us or 0.0 for c in e.conns)


# ------------------------------------------------------------------ schedule -------


def test_1f1b_programs_are_deadlock_free_and_complete() -> None:
    for stages in (1, 2, 4, 8):
        for mbs in (stages, 2 * stages, 8):
            sends, recvs = set(), set()
            for s in range(stages):
                prog = one_f_one_b(s, stages, mbs)
                assert sorted(prog) == sorted([("F", 0, m) for m in range(mbs)] +
                                              [("B", 0, m) for m in range(mbs)])  # fmt: skip
                for step in prog:
                    inp, out = transfers_of(step, s, stages, 1)
                    recvs |= {inp} - {None}
                    sends |= {out} - {None}
            assert sends == recvs and len(sends) == 2 * mbs * (stages - 1)


# ------------------------------------------------------------------ 1F1B physics ---


def test_1f1b_bubbles_are_receive_waits_of_p_minus_1_microbatches_per_step() -> None:
    """In a balanced 1F1B pipeline every stage idles (P-1)(F+B) per step: the fill and
    the drain. Sends do not block compute, so the idle time is the Recv kernels' wait:
    the last stage waits for activations, the first for gradients, the middle both."""
    cfg = BASE
    evs = events(cfg)
    fb_us = cfg.iteration_s / cfg.microbatches * 1e6  # F + B of one microbatch
    rs = [e for e in ops(evs, "dp-s0-rail0", "ReduceScatter") if e.rank == 0]
    steps = [e.ts_us for e in rs if us(2) <= e.ts_us < us(9)]
    lo, hi = steps[0], steps[-1]
    n_steps = len(steps) - 1
    for s in range(cfg.pp):
        recv = [
            e for e in ops(evs, "pp-", "Recv")
            if stage_of(e.host, cfg) == s and e.gpu == 0 and lo < e.ts_us <= hi
        ]  # fmt: skip
        per_host = defaultdict(float)
        for e in recv:
            per_host[e.host] += wait_us(e)
        for host, total in per_host.items():
            per_step = total / n_steps
            assert per_step == pytest.approx((cfg.pp - 1) * fb_us, rel=0.15), (s, host)
        dirs = {"f" if (e.comm_name.split("-")[1] == f"s{s - 1}") else "b" for e in recv}
        assert dirs == ({"b"} if s == 0 else {"f"} if s == cfg.pp - 1 else {"f", "b"})


def test_1f1b_the_last_stage_waits_at_the_start_of_each_step() -> None:
    """The last stage's first Recv of a step waits for the drain of the last step and
    the fill of this one, (P-1)(F+B) in all; its other receives wait for nothing."""
    cfg = BASE
    evs = events(cfg)
    f_us = cfg.iteration_s / cfg.microbatches / 3 * 1e6
    recv = sorted(
        (
            e
            for e in ops(evs, "pp-s2-node-004-g0", "Recv")
            if e.host == "node-006" and us(2) <= e.ts_us < us(9)
        ),
        key=lambda e: e.ts_us,
    )
    # group into steps: a new step starts after the long wait
    waits = np.array([wait_us(e) for e in recv])
    big = waits > 2 * f_us
    assert big.sum() >= 10
    # one long wait per step, M receives per step
    assert np.diff(np.nonzero(big)[0]).tolist() == [cfg.microbatches] * (big.sum() - 1)
    assert np.median(waits[big]) == pytest.approx((cfg.pp - 1) * 3 * f_us, rel=0.1)
    assert np.median(waits[~big]) < 0.05 * f_us


def test_sends_wait_for_the_receiver_too() -> None:
    """A p2p kernel's time includes waiting for the other stage: stage 0's Sends in
    the steady phase wait until stage 1 is ready to receive."""
    evs = events(BASE)
    send = [e for e in ops(evs, "pp-s0-", "Send") if us(2) < e.ts_us < us(9) and e.gpu == 0]
    waits = np.array([wait_us(e) for e in send])
    f_us = BASE.iteration_s / BASE.microbatches / 3 * 1e6
    n_steps = 7 / measure_step_s(BASE)
    # one send per host and step waits for the receiver's whole backward phase
    assert (waits > f_us).sum() / 2 == pytest.approx(n_steps, rel=0.2)


def test_per_layer_tp_collectives_and_zero_counts_per_step() -> None:
    cfg = BASE
    evs = events(R(cfg, duration_s=4))
    rs = [e for e in ops(evs, "dp-s1-rail1", "ReduceScatter") if e.rank == 0]
    ag = [e for e in ops(evs, "dp-s1-rail1", "AllGather") if e.rank == 0]
    tp = [e for e in ops(evs, "tp-node-002", "AllReduce") if e.rank == 0]
    assert abs(len(rs) - len(ag)) <= 1
    steps = len(rs)
    # 4 TP AllReduces per layer per microbatch (2 forward, 2 backward)
    assert len(tp) == pytest.approx(4 * cfg.layers * cfg.microbatches * steps, rel=0.15)
    assert {e.op for e in ops(evs, "tp-")} == {"AllReduce"}
    assert {e.op for e in ops(evs, "dp-")} == {"ReduceScatter", "AllGather"}
    e = rs[0]
    assert all(c.bytes == (1 << 20) // 2 for c in e.conns)  # (n-1)/n of the bucket, n = 2


def test_fsdp_gathers_per_use_and_reduces_once_per_step() -> None:
    cfg = R(BASE, dp_mode="fsdp", layers=4, dp_buckets=2, duration_s=4)
    evs = events(cfg)
    ring = [e for e in ops(evs, "dp-s2-rail0") if e.rank == 0]
    rs = sum(e.op == "ReduceScatter" for e in ring)
    ag = sum(e.op == "AllGather" for e in ring)
    # per step: 2 buckets gathered in every forward and backward of 8 microbatches
    assert ag == pytest.approx(2 * 2 * cfg.microbatches * rs / 2, rel=0.15)


def test_interleaved_has_the_wrap_link_and_less_bubble() -> None:
    cfg = R(BASE, schedule="interleaved", virtual_stages=2, layers=2, duration_s=6)
    evs = events(cfg)
    assert ops(evs, "pp-s3-")  # last stage -> first stage (chunk 1 starts on stage 0)
    plain = events(R(BASE, duration_s=6))

    def steps(ev) -> int:
        return sum(1 for e in ops(ev, "dp-s0-rail0", "ReduceScatter") if e.rank == 0)

    # same compute per step; the interleaved bubble is 1/v of 1F1B's
    assert steps(evs) > steps(plain)
    assert measure_step_s(cfg) < measure_step_s(BASE)


def test_moe_all_to_all_in_expert_groups() -> None:
    cfg = R(BASE, hosts=16, moe_every=2, ep=2, duration_s=3)
    evs = events(cfg)
    a2a = ops(evs, "ep-", "AllToAll")
    assert a2a and all(e.nranks == 2 for e in a2a)
    assert {len(e.conns) for e in a2a} == {2}  # send to and receive from the one peer
    names = {e.comm_name for e in a2a}
    assert names == {f"ep-s{s}-rail{r}-{k}" for s in range(4) for r in range(2) for k in range(2)}


# ------------------------------------------------------------------ steps, rates ---


def test_a_46_second_step_with_one_reduce_scatter_per_ring_per_step() -> None:
    cfg = SCENARIOS["long_step_healthy"]
    evs = events(R(cfg, duration_s=200))
    rs = sorted(
        (e.ts_us for e in ops(evs, "dp-rail0", "ReduceScatter") if e.rank == 0),
    )
    gaps = np.diff(rs) / 1e6
    assert len(rs) >= 3 and np.all(np.abs(gaps - 46) < 2.5), gaps
    hb = [e for e in evs if isinstance(e, ProgressEvent) and e.comm_name == "dp-rail0"]
    assert len(hb) >= 4 * 190  # heartbeats every second between the collectives


@pytest.mark.parametrize("rate", [200, 1000])
def test_the_rate_knob_gives_the_rate_asked(rate: int) -> None:
    cfg = with_rate(R(BASE, duration_s=3), rate, step_s=0.5)
    evs = events(cfg)
    done = len(ops(evs)) / cfg.gpus / cfg.duration_s
    assert done == pytest.approx(rate, rel=0.15)
    assert collectives_per_step(cfg) / measure_step_s(cfg) == pytest.approx(rate, rel=0.1)


def test_step_time_is_selectable() -> None:
    for step in (0.05, 1.0, 10.0):
        assert measure_step_s(with_step(BASE, step)) == pytest.approx(step, rel=0.1)


def test_deterministic_and_the_classic_shape_unchanged() -> None:
    cfg = R(SCENARIOS["pp_moe"], duration_s=2, hosts=8, gpu_spread=0.01)
    a = [encode_message(b) for b in simulate(cfg)]
    assert a == [encode_message(b) for b in simulate(cfg)]
    assert a != [encode_message(b) for b in simulate(R(cfg, seed=1))]

    def digest(c: SimConfig) -> str:
        h = hashlib.sha256()
        for b in simulate(c):
            h.update(encode_message(b))
        return h.hexdigest()[:16]

    # the bytes the classic shape produced before the new shapes existed
    assert digest(R(SCENARIOS["demo"], duration_s=12, seed=7)) == "1f0789cdfd1a0f7c"
    assert digest(SimConfig(hosts=4, pp=2, duration_s=5)) == "0cf1305b50416d87"
    nic = R(SCENARIOS["slow_nic"].faults[0], host=1)
    assert digest(R(SCENARIOS["slow_nic"], duration_s=22, hosts=4, faults=[nic])) == (
        "4c144869d856d022"
    )


# ------------------------------------------------------------------ benign ---------


def test_static_spread_is_small_and_the_slowest_gpu_arrives_last() -> None:
    cfg = R(BASE, gpu_spread=0.01, duration_s=4)
    sim = Simulation(cfg)
    speed = sim.inj.speed
    assert speed is not None and np.all(np.abs(speed - 1) <= 0.01)
    evs = events(cfg)
    host = "node-002"
    slow_gpu = int(np.argmax(speed[4:6]))  # the slower GPU of node-002 arrives last
    per_seq: dict[int, dict[int, float]] = defaultdict(dict)
    for e in ops(evs, f"tp-{host}"):
        per_seq[e.seq][e.gpu] = e.exec_us
    last = [min(v, key=v.get) for v in per_seq.values() if len(v) == 2]
    assert last.count(slow_gpu) / len(last) > 0.9


def test_a_heavy_stage_makes_the_others_wait() -> None:
    cfg = R(BASE, benign=[BenignSpec(kind="stage_heavy", stage=1, severity=1.5)], duration_s=6)
    evs = events(cfg)

    def recv_wait(stage: int) -> float:
        return float(np.mean([wait_us(e) for e in ops(evs, "pp-", "Recv")
                              if stage_of(e.host, cfg) == stage and e.ts_us > us(2)]))  # fmt: skip

    assert recv_wait(1) < 0.5 * min(recv_wait(0), recv_wait(2), recv_wait(3))
    gt = ground_truth(cfg)
    assert gt.benign[0].stage == 1 and not gt.faults


# ------------------------------------------------------------------ faults ---------


def test_a_pipeline_straggler_arrives_last_and_its_peers_wait() -> None:
    fault = FaultSpec(kind="straggler", host=3, gpu=1, start_s=3, severity=1.2)
    cfg = R(BASE, faults=[fault], duration_s=7)
    evs = events(cfg)
    per_seq: dict[int, dict[int, float]] = defaultdict(dict)
    for e in ops(evs, "tp-node-003"):
        if e.ts_us > us(3.5):
            per_seq[e.seq][e.gpu] = e.exec_us
    last = [min(v, key=v.get) for v in per_seq.values() if len(v) == 2]
    assert last.count(1) / len(last) > 0.95
    # its DP ring peer (the other host of stage 1, same rail) waits for it at the
    # ReduceScatter, and the whole pipeline slows to the straggling stage
    rs: dict[int, dict[str, float]] = defaultdict(dict)
    for e in ops(evs, "dp-s1-rail1", "ReduceScatter"):
        if e.ts_us > us(3.5):
            rs[e.seq][e.host] = e.exec_us
    assert all(v["node-002"] > v["node-003"] + 1e4 for v in rs.values())
    base = events(R(BASE, duration_s=7))

    def step_ms(ev, ring: str) -> float:
        ts = sorted(e.ts_us for e in ops(ev, ring, "ReduceScatter") if e.rank == 0)
        return float(np.median(np.diff([t for t in ts if t > us(4)]))) / 1e3

    for ring in ("dp-s0-rail0", "dp-s3-rail1"):
        assert step_ms(evs, ring) > 1.05 * step_ms(base, ring)
    assert ground_truth(cfg).faults[0].stage == 1


def test_an_intermittent_straggler_is_slow_on_a_share_of_steps() -> None:
    fault = FaultSpec(kind="straggler", host=3, gpu=1, start_s=0, severity=1.5, duty=0.3)
    sim = Simulation(R(BASE, faults=[fault]))
    slow = []
    for step in range(2000):
        sim.inj.begin_step(step)
        slow.append(sim.inj.slow_step[0])
    assert 0.27 < np.mean(slow) < 0.33
    gt = ground_truth(R(BASE, faults=[fault]))
    assert gt.faults[0].duty == 0.3 and gt.faults[0].expected_fault == "straggler"
    # in the trace: the GPU is last in its TP group on about 30 % of steps only
    evs = events(R(BASE, faults=[fault], duration_s=20))
    per_seq: dict[int, dict[int, float]] = defaultdict(dict)
    for e in ops(evs, "tp-node-003"):
        per_seq[e.seq][e.gpu] = e.exec_us
    last = [min(v, key=v.get) == 1 for _, v in sorted(per_seq.items()) if len(v) == 2]
    share = float(np.mean(last))
    assert 0.2 < share < 0.4  # no noise: on its fast steps it ties and GPU 0 counts last


def test_a_one_way_slow_pipeline_link_slows_only_that_direction() -> None:
    fault = FaultSpec(kind="slow_link", host=2, peer_host=4, nic=1, start_s=2, severity=0.4)
    cfg = R(BASE, faults=[fault], duration_s=5)
    validate(cfg)
    evs = events(cfg)
    nominal = (1 << 16) / 25e9 * 1e6
    comm = "pp-s1-node-002-g1"

    def times(op: str, comm_name: str) -> set[float]:
        return {round(e.conns[0].time_us / nominal, 1) for e in ops(evs, comm_name, op)
                if e.ts_us > us(2.5)}  # fmt: skip

    assert times("Send", comm) | times("Recv", comm) == {1.0, 2.5}
    fwd = {round(e.conns[0].time_us / nominal, 1) for e in ops(evs, comm, "Send")
           if e.host == "node-002" and e.ts_us > us(2.5)}  # fmt: skip
    back = {round(e.conns[0].time_us / nominal, 1) for e in ops(evs, comm, "Send")
            if e.host == "node-004" and e.ts_us > us(2.5)}  # fmt: skip
    assert fwd == {2.5} and back == {1.0}
    assert times("Send", "pp-s1-node-002-g0") == {1.0}  # the other rail
    assert times("Send", "pp-s1-node-003-g1") == {1.0}  # the other replica
    gt = ground_truth(cfg).faults[0]
    assert (gt.host, gt.peer_host, gt.nic, gt.expected_fault) == (
        "node-002", "node-004", "mlx5_1", "slow_link",
    )  # fmt: skip


def test_a_slow_nic_whose_only_ring_peer_is_one_neighbour() -> None:
    """Two hosts per stage: the DP ring's only remote peer is the neighbour, so both
    ends of that hop are slow in the ring; the pipeline pairs of the slow NIC are slow
    and the neighbour's are not — the evidence that tells the two apart."""
    fault = FaultSpec(kind="slow_nic", host=3, nic=0, start_s=2, severity=0.5)
    cfg = R(BASE, faults=[fault], duration_s=5)
    evs = events(cfg)
    ring = [e for e in ops(evs, "dp-s1-rail0") if e.ts_us > us(2.5)]
    nominal = (1 << 20) / 2 / 25e9 * 1e6
    assert {round(c.time_us / nominal, 1) for e in ring for c in e.conns} == {2.0}
    pp_nominal = (1 << 16) / 25e9 * 1e6

    def pp_ratio(host: str) -> set[float]:
        return {round(e.conns[0].time_us / pp_nominal, 1) for e in ops(evs, "pp-")
                if e.host == host and e.gpu == 0 and e.ts_us > us(2.5)}  # fmt: skip

    assert pp_ratio("node-003") == {2.0}
    assert pp_ratio("node-002") == {1.0}


def test_a_degrading_nic_and_its_threshold_in_the_truth() -> None:
    fault = FaultSpec(kind="slow_nic", host=3, nic=0, start_s=2, ramp_s=6, severity=0.4)
    cfg = R(BASE, faults=[fault], duration_s=10)
    gt = ground_truth(cfg).faults[0]
    assert gt.start_us == us(2) and gt.ramp_s == 6
    assert gt.threshold_us == us(2 + 6 * 0.25 / 0.6)  # remaining bandwidth crosses 0.75
    evs = events(cfg)
    nominal = (1 << 16) / 25e9 * 1e6
    send = sorted((e for e in ops(evs, "pp-", "Send") if e.host == "node-003" and e.gpu == 0),
                  key=lambda e: e.ts_us)  # fmt: skip
    frac = [(e.ts_us - EPOCH_US) / 1e6 for e in send], [nominal / e.conns[0].time_us for e in send]
    for t, f in zip(*frac, strict=True):
        expect = 1.0 - 0.6 * min(max((t - 2) / 6, 0.0), 1.0)
        assert f == pytest.approx(expect, abs=0.08), t


@pytest.mark.parametrize("kind", ["rank_hang", "host_down", "link_hang"])
def test_hangs_on_the_pipeline_stop_every_stage(kind: str) -> None:
    spec = {
        "rank_hang": FaultSpec(kind="rank_hang", host=3, gpu=1, start_s=3),
        "host_down": FaultSpec(kind="host_down", host=3, start_s=3),
        "link_hang": FaultSpec(kind="link_hang", host=2, peer_host=3, nic=0, start_s=3),
    }[kind]
    cfg = R(BASE, faults=[spec], duration_s=8)
    evs = events(cfg)
    assert not [e for e in ops(evs) if e.ts_us > us(5)], "the whole pipeline stops"
    late = [e for e in evs if isinstance(e, ProgressEvent) and e.ts_us > us(6)]
    stuck = [e for e in late if e.started > e.completed]  # an async Send may be one of them
    assert stuck and {stage_of(e.host, cfg) for e in stuck} == {0, 1, 2, 3}
    if kind == "host_down":
        assert not [e for e in evs if e.host == "node-003" and e.ts_us > us(3.1)]
    if kind == "link_hang":
        sender = [e for e in late if e.host == "node-002" and e.comm_name == "dp-s1-rail0"]
        assert sender and all(
            next(c.retrans for c in e.conns if c.dir == "send") > 0 for e in sender
        )


def test_bad_shapes_say_what_to_fix() -> None:
    with pytest.raises(SimConfigError, match="multiple of pp"):
        validate(R(BASE, schedule="interleaved", microbatches=6))
    with pytest.raises(SimConfigError, match="ep=3"):
        validate(R(BASE, moe_every=2, ep=3))
    with pytest.raises(SimConfigError, match="pipeline schedule"):
        validate(SimConfig(benign=[BenignSpec(kind="stage_heavy", stage=0)]))
    with pytest.raises(SimConfigError, match="duty"):
        validate(R(BASE, faults=[FaultSpec(kind="slow_nic", host=1, nic=0, start_s=1,
                                           duty=0.5)]))  # fmt: skip
    with pytest.raises(SimConfigError, match="--rate"):
        with_rate(R(BASE, duration_s=1), 100_000, step_s=0.1)


def test_every_new_scenario_is_valid_and_listed() -> None:
    new = [n for n, c in SCENARIOS.items() if c.pipelined]
    assert len(new) >= 15
    for name in new:
        gt = ground_truth(SCENARIOS[name])
        assert gt.shape and gt.gpus == SCENARIOS[name].gpus
