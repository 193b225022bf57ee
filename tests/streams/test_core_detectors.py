"""Unit tests of the detection core on small hand-made event sequences."""

from __future__ import annotations

import numpy as np
import pytest

from producers.events import Conn, OpEvent, ProgressEvent
from streams.core import CommDetector, DetectConfig, HostCorrelator, PolicyConfig
from streams.core.aligner import SeqAligner, _row_median
from streams.core.slow_conn import ConnMatrix
from streams.core.stats import robust_z

T0 = 1_750_000_000_000_000
CFG = DetectConfig(warmup_us=0)


def hb(rank: int, ts: int, started: int, completed: int, inflight: float = 0.0, n: int = 8,
       host: str | None = None, conns: list[Conn] | None = None) -> ProgressEvent:  # fmt: skip
    infl = inflight if started > completed else None
    return ProgressEvent(v=1, job="j", comm="c1", comm_name="dp-rail0", nranks=n, rank=rank,
                         host=host or f"node-{rank:03d}", gpu=0, nic="mlx5_0", ts_us=ts,
                         started=started, completed=completed, inflight_us=infl,
                         conns=conns)  # fmt: skip


def op(rank: int, seq: int, exec_us: float, ts: int, n: int = 8,
       conns: list[Conn] | None = None) -> OpEvent:  # fmt: skip
    return OpEvent(v=1, job="j", comm="c1", comm_name="dp-rail0", nranks=n, rank=rank,
                   host=f"node-{rank:03d}", gpu=0, nic="mlx5_0", ts_us=ts, op="AllReduce",
                   seq=seq, bytes=1 << 20, exec_us=exec_us, conns=conns)  # fmt: skip


def run_heartbeats(det: CommDetector, seconds: int, state) -> list:  # noqa: ANN001
    out = []
    for sec in range(1, seconds + 1):
        ts = T0 + sec * 1_000_000
        out += det.observe([e for r in range(8) if (e := state(r, sec, ts)) is not None])
    return out


@pytest.mark.timeout(10)
def test_noncomm_hang_names_the_rank_behind() -> None:
    det = CommDetector("c1", CFG)

    def state(r: int, sec: int, ts: int):  # noqa: ANN202
        if r == 5:
            return hb(r, ts, 10, 10)  # frozen counters: never starts collective 11
        return hb(r, ts, 11, 10, inflight=sec * 1e6)

    out = [v for v in run_heartbeats(det, 6, state) if not v.benign]
    assert out, "a hang was not reported"
    assert {(v.fault, v.host) for v in out} == {("noncomm_hang", "node-005")}
    assert out[0].evidence["target_collective"] == 11
    assert "has not started collective 11" in out[0].reason


@pytest.mark.timeout(10)
def test_silent_host_is_a_noncomm_hang_culprit() -> None:
    det = CommDetector("c1", CFG)

    def state(r: int, sec: int, ts: int):  # noqa: ANN202
        if r == 2 and sec > 2:
            return None  # host died at second 3
        return hb(r, ts, 11, 10, inflight=sec * 1e6)

    out = [v for v in run_heartbeats(det, 9, state) if not v.benign]
    assert {(v.fault, v.host) for v in out} == {("noncomm_hang", "node-002")}
    assert out[0].evidence["silent"] is True


@pytest.mark.timeout(10)
def test_comm_hang_localized_by_retransmits() -> None:
    det = CommDetector("c1", CFG)

    def state(r: int, sec: int, ts: int):  # noqa: ANN202
        stuck = sec >= 2
        nxt, prv = (r + 1) % 8, (r - 1) % 8
        send = 1000 if (stuck and r == 3) else 1000 * sec
        recv = 1000 if (stuck and prv == 3) else 1000 * sec
        rt = 10 * sec if (stuck and r == 3) else 0
        conns = [Conn(peer=nxt, dir="send", bytes=send, retrans=rt),
                 Conn(peer=prv, dir="recv", bytes=recv)]  # fmt: skip
        return hb(r, ts, 11, 10, inflight=sec * 1e6, conns=conns)

    out = [v for v in run_heartbeats(det, 6, state) if not v.benign]
    assert out
    assert {(v.fault, v.host, v.nic, v.peer_host) for v in out} == {
        ("comm_hang", "node-003", "mlx5_0", "node-004")
    }


@pytest.mark.timeout(10)
def test_everybody_idle_or_gone_is_not_a_hang() -> None:
    det = CommDetector("c1", CFG)
    # all ranks idle (a checkpoint between collectives), then the whole job stops
    out = run_heartbeats(det, 5, lambda r, sec, ts: hb(r, ts, 10, 10))
    out += det.advance(T0 + 30_000_000)
    # only the census note (which hosts the communicator spans), nothing about a hang
    assert [v.evidence["role"] for v in out] == ["census"] and all(v.benign for v in out)


def _ops_window(
    det: CommDetector,
    seconds: int,
    late_rank: int | None,
    blip_seq: int = -1,
    late_from_s: int = 10,
    structural: dict[int, float] | None = None,
):
    """Ops of 8 ranks, 4 collectives a second; ``late_rank`` arrives 60 ms late from
    ``late_from_s`` on; ``structural`` ranks arrive that many µs late all along."""
    rng = np.random.default_rng(0)
    out, seq = [], 0
    for sec in range(seconds):
        ts = T0 + sec * 1_000_000
        batch = []
        for _ in range(4):  # 4 collectives a second
            x = 20_000 + rng.normal(0, 300, 8)
            late = {**(structural or {})}
            if late_rank is not None and sec >= late_from_s:
                late[late_rank] = 60_000.0
            elif seq == blip_seq:
                late[1] = 60_000.0
            if late:  # ring model: the last to arrive waits for nobody, the others for it
                worst = max(late.values())
                x = x + worst - np.array([late.get(r, 0.0) for r in range(8)])
            batch += [op(r, seq, float(x[r]), ts) for r in range(8)]
            seq += 1
        out += det.observe(batch)
    out += det.advance(T0 + (seconds + 1) * 1_000_000)
    return out


@pytest.mark.timeout(10)
def test_straggler_has_the_shortest_kernel_time() -> None:
    out = [v for v in _ops_window(CommDetector("c1", CFG), 26, late_rank=6) if not v.benign]
    assert out and {(v.fault, v.host) for v in out} == {("straggler", "node-006")}
    assert out[0].evidence["last_frac"] >= 0.9


@pytest.mark.timeout(10)
def test_no_straggler_when_healthy_or_single_blip() -> None:
    assert [v for v in _ops_window(CommDetector("c1", CFG), 16, None) if not v.benign] == []
    blip = _ops_window(CommDetector("c1", CFG), 16, None, blip_seq=30)
    assert [v for v in blip if not v.benign] == []


@pytest.mark.timeout(10)
def test_slow_conn_matrix_tells_nic_from_link() -> None:
    hosts = np.arange(8)
    m = ConnMatrix()
    for s in range(8):  # ring; host 2's NIC at half speed: cells 1->2 and 2->3 slow
        m.add(s, (s + 1) % 8, 1000, 20.0 if s in (1, 2) else 10.0)
    assert [(f.kind, f.rank) for f in m.judge(hosts, 0.75, 3)] == [("nic", 2)]
    m.reset()
    for s in range(8):  # only link 5->6 slow
        m.add(s, (s + 1) % 8, 1000, 25.0 if s == 5 else 10.0)
    assert [(f.kind, f.rank, f.peer) for f in m.judge(hosts, 0.75, 3)] == [("link", 5, 6)]
    m.reset()
    for s in range(8):  # everybody slower together: nothing
        m.add(s, (s + 1) % 8, 1000, 30.0)
    assert m.judge(hosts, 0.75, 3) == []


@pytest.mark.timeout(10)
def test_slow_nic_through_comm_detector_op_conns() -> None:
    det = CommDetector("c1", CFG)
    out, seq = [], 0
    for sec in range(12):
        ts = T0 + sec * 1_000_000
        batch = []
        for _ in range(2):
            for r in range(8):
                # NIC of rank 4 at half speed: cells 3->4 and 4->5, seen by both ends
                t_send = 200.0 if r in (3, 4) else 100.0
                t_recv = 200.0 if r in (4, 5) else 100.0
                conns = [
                    Conn(peer=(r + 1) % 8, dir="send", bytes=10_000, time_us=t_send),
                    Conn(peer=(r - 1) % 8, dir="recv", bytes=10_000, time_us=t_recv),
                ]
                batch.append(op(r, seq, 20_000.0, ts, conns=conns))
            seq += 1
        out += det.observe(batch)
    slow = [v for v in out if v.fault == "slow_nic"]
    assert slow and {(v.host, v.nic) for v in slow} == {("node-004", "mlx5_0")}
    assert all(v.fault == "slow_nic" for v in out if not v.benign)


@pytest.mark.timeout(10)
def test_checkpoint_restore_gives_the_same_verdicts() -> None:
    def state(r: int, sec: int, ts: int):  # noqa: ANN202
        return hb(r, ts, 10, 10) if r == 5 else hb(r, ts, 11, 10, inflight=sec * 1e6)

    full = CommDetector("c1", CFG)
    want = run_heartbeats(full, 8, state)
    a = CommDetector("c1", CFG)
    got = []
    for sec in range(1, 9):
        ts = T0 + sec * 1_000_000
        got += a.observe([state(r, sec, ts) for r in range(8)])
        a = CommDetector.from_bytes(a.to_bytes(), CFG)  # restart after every batch
    assert [v.id for v in got] == [v.id for v in want] and want


def test_statistics_agree_with_numpy() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(10, 2, (50, 9))
    x[rng.random(x.shape) < 0.2] = np.nan
    cnt = (~np.isnan(x)).sum(axis=1)
    np.testing.assert_allclose(_row_median(x, cnt), np.nanmedian(x, axis=1))
    y = rng.normal(0, 1, 101)
    mad = np.median(np.abs(y - np.median(y))) * 1.4826
    np.testing.assert_allclose(robust_z(y), (y - np.median(y)) / mad)


def test_aligner_bounded_ring_drops_too_old_collectives() -> None:
    a = SeqAligner(nranks=2, ring=4)
    for s in range(10):
        a.insert(np.array([0, 1]), np.array([s, s]), np.array([1.0, 2.0]), 0)
    a.insert(np.array([0]), np.array([1]), np.array([5.0]), 0)  # long gone: ignored
    assert a.exec.shape == (4, 2) and set(a.tag.tolist()) <= {-1, 6, 7, 8, 9}


@pytest.mark.timeout(30)
def test_pipeline_routes_every_event_whatever_the_batching() -> None:
    import msgspec

    from producers.simulator import SCENARIOS, simulate
    from streams.core import DetectionPipeline

    cfg = msgspec.structs.replace(SCENARIOS["healthy"], hosts=4, duration_s=8)
    batches = list(simulate(cfg))
    want: dict[str, int] = {}
    for b in batches:
        for e in b:
            want[e.comm] = want.get(e.comm, 0) + 1
    for chunks in (batches, [e for b in batches for e in b]):  # exporter batches, or one stream
        p = DetectionPipeline()
        if chunks is batches:
            for b in batches:
                p.feed(b)
        else:
            p.feed(iter(chunks))
        p.finish()
        assert {c: d.n_events for c, d in p.detectors.items()} == want
        assert p.n_events == sum(want.values())


@pytest.mark.timeout(10)
def test_straggler_from_the_first_collective_is_found_against_its_peers() -> None:
    """Rank 5 is 60 ms late from its very first collective: peers are the reference,
    so its own history cannot absorb the fault as its normal."""
    out = _ops_window(CommDetector("c1", CFG), 12, late_rank=5, late_from_s=0)
    flagged = [v for v in out if not v.benign]
    assert {(v.fault, v.host) for v in flagged} == {("straggler", "node-005")}
    assert min(v.window_start_us for v in flagged) < T0 + 5_000_000  # the first window
    assert flagged[0].evidence["position"] == 5


def _replica_verdicts(comm: str, host_of: dict[int, str], late: dict[int, float]) -> list:
    """One 8-rank communicator (one replica) on its own hosts, ``late`` ranks that
    many µs late from the first collective."""
    det = CommDetector(comm, CFG)
    rng = np.random.default_rng(int(comm[1:]))
    out, seq = [], 0
    for sec in range(16):
        ts = T0 + sec * 1_000_000
        batch = []
        for _ in range(4):
            x = 20_000 + rng.normal(0, 300, 8)
            worst = max(late.values(), default=0.0)
            x = x + worst - np.array([late.get(r, 0.0) for r in range(8)])
            batch += [
                OpEvent(
                    v=1,
                    job="j",
                    comm=comm,
                    comm_name=f"tp-{comm}",
                    nranks=8,
                    rank=r,
                    host=host_of[r],
                    gpu=r,
                    ts_us=ts,
                    op="AllReduce",
                    seq=seq,
                    bytes=1 << 20,
                    exec_us=float(x[r]),
                )  # fmt: skip
                for r in range(8)
            ]
            seq += 1
        out += det.observe(batch)
    return out + det.advance(T0 + 17_000_000)


@pytest.mark.timeout(20)
def test_a_late_role_is_not_isolated_a_faulty_gpu_is() -> None:
    """Rank 3 of every replica (four one-host communicators) is 8 ms late by its role:
    the same position late in every replica is not a fault. In a fifth replica rank 6
    is late too, at its own position only: that GPU is isolated."""
    verdicts = []
    for k in range(5):
        hosts = {r: f"node-{k:03d}" for r in range(8)}
        late = {3: 8_000.0} if k < 4 else {3: 8_000.0, 6: 30_000.0}
        verdicts += _replica_verdicts(f"c{k}", hosts, late)
    flagged = {(v.host, v.gpu) for v in verdicts if not v.benign}
    assert {("node-000", 3), ("node-004", 6)} <= flagged  # the detectors see both
    cor = HostCorrelator(PolicyConfig())
    cmds = []
    for v in sorted(verdicts, key=lambda v: (v.ts_us, not v.benign)):
        cmds += cor.observe(v)
    isolated = {(c.host, c.gpu, c.fault) for c in cmds if c.action != "alert_only"}
    assert isolated == {("node-004", 6, "straggler")}
