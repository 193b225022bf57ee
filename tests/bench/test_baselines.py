"""The two baselines on small hand-made event sequences: when they fire, whom they blame."""

from __future__ import annotations

import pytest

from bench.baselines import NcclRas, RasConfig, Watchdog, WatchdogConfig, nccl_ras, watchdog
from producers.events import OpEvent, ProgressEvent

S = 1_000_000  # µs per second

pytestmark = pytest.mark.timeout(30)


def hb(
    rank: int,
    t_s: float,
    started: int,
    completed: int,
    inflight_s: float | None = None,
    comm: str = "0xa",
    nranks: int = 4,
) -> ProgressEvent:
    """A heartbeat of ``rank`` (host node-<rank>, GPU rank % 8) at ``t_s`` seconds."""
    return ProgressEvent(
        v=1,
        job="j",
        comm=comm,
        nranks=nranks,
        rank=rank,
        host=f"node-{rank:03d}",
        gpu=rank % 8,
        ts_us=int(t_s * S),
        started=started,
        completed=completed,
        inflight_op=None if inflight_s is None else "AllReduce",
        inflight_us=None if inflight_s is None else inflight_s * S,
    )


def op(rank: int, t_s: float, seq: int, comm: str = "0xa") -> OpEvent:
    return OpEvent(
        v=1, job="j", comm=comm, nranks=4, rank=rank, host=f"node-{rank:03d}",
        ts_us=int(t_s * S), op="AllReduce", seq=seq, bytes=1 << 20, exec_us=900.0,
    )  # fmt: skip


def hung_comm(seconds: range, behind: set[int], top: int = 10, comm: str = "0xa") -> list:
    """Heartbeats of a 4-rank comm stuck in collective ``top`` since ``seconds[0]``.

    Ranks in ``behind`` never started it (started = top - 1, nothing in flight)."""
    out = []
    for t in seconds:
        for r in range(4):
            if r in behind:
                out.append(hb(r, t, top - 1, top - 1, comm=comm))
            else:
                out.append(hb(r, t, top, top - 1, inflight_s=t - seconds[0], comm=comm))
    return out


# ----------------------------------------------------------------------- watchdog


def test_watchdog_fires_once_at_ten_minutes_without_naming_a_host() -> None:
    events = hung_comm(range(0, 700, 10), behind={2})
    decisions = watchdog(events)
    assert len(decisions) == 1
    d = decisions[0]
    assert d.ts_us == 600 * S  # the first heartbeat with 600 s in flight
    assert d.host is None and d.gpu is None and d.fault is None
    assert d.action == "restart_job" and d.isolating


def test_watchdog_does_not_fire_before_the_timeout() -> None:
    assert watchdog(hung_comm(range(0, 600, 1), behind={2})) == []


def test_watchdog_timeout_is_configurable() -> None:
    decisions = watchdog(
        hung_comm(range(0, 100, 5), behind=set()), WatchdogConfig(timeout_us=30 * S)
    )
    assert [d.ts_us for d in decisions] == [30 * S]


def test_watchdog_fires_on_no_completion_when_inflight_time_is_not_reported() -> None:
    # An exporter that only counts: started > completed and 'completed' frozen for 600 s.
    events = [hb(0, t, 11, 10) for t in range(0, 620, 20)]
    decisions = watchdog(events)
    assert [d.ts_us for d in decisions] == [600 * S]


def test_watchdog_ignores_idle_ranks_and_progressing_ranks() -> None:
    idle = [hb(0, t, 10, 10) for t in range(0, 1300, 50)]  # nothing in flight, ever
    # always something in flight at the heartbeat, but it completes each time
    busy = [hb(1, t, 10 + t, 9 + t, inflight_s=0.5) for t in range(0, 1300, 50)]
    ops = [op(2, t, t) for t in range(1300)]
    assert watchdog(idle + busy + ops) == []


def test_watchdog_stays_quiet_after_firing() -> None:
    wd = Watchdog()
    first = wd.feed(hung_comm(range(0, 601, 100), behind=set()))
    assert len(first) == 1
    assert wd.feed(hung_comm(range(700, 2000, 100), behind=set())) == []
    assert wd.fired == first[0]


# ----------------------------------------------------------------------- NCCL-RAS rule


def test_ras_blames_the_rank_that_never_joined_after_20_s() -> None:
    decisions = nccl_ras(hung_comm(range(0, 40), behind={2}))
    assert [(d.host, d.gpu, d.fault, d.action) for d in decisions] == [
        ("node-002", 2, "noncomm_hang", "cordon")
    ]
    assert decisions[0].ts_us == 20 * S  # first heartbeat with 20 s in flight
    assert "rank 2" in decisions[0].reason


def test_ras_is_silent_below_20_s_and_on_healthy_traffic() -> None:
    assert nccl_ras(hung_comm(range(0, 20), behind={2})) == []
    healthy = [hb(r, t, t, t - 1, inflight_s=0.2) for t in range(1, 100) for r in range(4)]
    assert nccl_ras(healthy + [op(1, 3, 3)]) == []


def test_ras_blames_nobody_when_every_rank_joined() -> None:
    decisions = nccl_ras(hung_comm(range(0, 60), behind=set()))
    assert len(decisions) == 1  # one report per stuck collective, not one per heartbeat
    d = decisions[0]
    assert d.host is None and d.fault == "comm_hang"
    assert d.action == "alert_only" and not d.isolating


def test_ras_blames_a_silent_rank_by_its_last_count() -> None:
    # host 3 dies at t=0.5: its last heartbeat says it finished op 9 and never started 10
    events = [hb(r, 0, 9, 9) for r in range(4)]
    events += [hb(r, t, 10, 9, inflight_s=t) for t in range(1, 30) for r in range(3)]
    decisions = nccl_ras(events)
    assert [(d.host, d.gpu) for d in decisions] == [("node-003", 3)]
    assert decisions[0].ts_us == 20 * S


def test_ras_blames_each_rank_once_across_comms_and_rearms_on_progress() -> None:
    ras = NcclRas(RasConfig(stuck_us=5 * S))
    a = ras.feed(hung_comm(range(0, 10), behind={1, 2}, comm="0xa"))
    b = ras.feed(hung_comm(range(0, 10), behind={1}, comm="0xb"))
    assert sorted(d.host for d in a) == ["node-001", "node-002"] and b == []
    # comm 0xb recovers, then gets stuck again at collective 20, rank 0 behind this time
    later = ras.feed(hung_comm(range(100, 110), behind={0}, top=20, comm="0xb"))
    assert [(d.host, d.ts_us) for d in later] == [("node-000", 105 * S)]
    assert ras.finish() == []
