"""Issue 25, the worker's side, without a broker: exact repeats dropped (never read as a
counter going back), signed replays and stale messages refused before corroboration,
the contest hold on the worker's own clock, uncorroborated communicators alert-only,
and op times refused when they break the physics."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from c4base.signing import host_key, signed_event_headers
from producers.columnar import ARROW_CONTENT_TYPE, encode_arrow
from producers.events import Event, OpEvent, ProgressEvent, encode_message
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter, EdgeLimits
from streams.app.engine import CoreEngine
from streams.app.trust import EventTrust, Freshness
from streams.verdicts import Verdict

T0 = 1_750_000_000_000_000
S = 1_000_000
CT = ARROW_CONTENT_TYPE.encode()
MASTER = bytes(range(32))


def op(rank: int, ts: int, seq: int, *, comm: str = "0xa", exec_us: float = 20.0, **kw: Any):
    return OpEvent(v=1, job=kw.pop("job", "j"), comm=comm, nranks=4, rank=rank,
                   host=kw.pop("host", f"node-{rank}"), ts_us=ts, op=kw.pop("op", "AllReduce"),
                   seq=seq, bytes=8, exec_us=exec_us, **kw)  # fmt: skip


def router(wall: list[float] | None = None, trust: EventTrust | None = None, **kw: Any):
    wall = wall if wall is not None else [0.0]
    return CommRouter(CoreEngine(), lambda key: None, checkpoint_every_events=10**9,
                      checkpoint_every_s=1e9, advance_every_us=250_000,
                      limits=EdgeLimits(**kw), clock=lambda: wall[0],
                      epoch=lambda: T0 / 1e6 + 60, trust=trust)  # fmt: skip


def rec(i: int, events: list[Event], arrow: bool = False, headers=None) -> Record:
    value = encode_arrow(events) if arrow else encode_message(events)
    hs = dict(headers or ())
    return Record("ev", 0, i, events[0].comm.encode(), value, None, CT if arrow else None,
                  hs.get("c4-host"), hs.get("c4-sig"), hs.get("c4-fresh"))  # fmt: skip


@pytest.mark.parametrize("arrow", [False, True], ids=["json", "arrow"])
def test_an_exact_repeat_of_a_message_with_several_ops_per_rank_is_dropped(arrow: bool) -> None:
    """The issue's identical re-sends: ops 214..217 of each rank in one message, sent
    again, were read as "seq went back from 217 to 214" and contested the communicator."""
    msg = [op(r, T0 + q * 1000, q) for q in range(214, 218) for r in range(4)]
    r = router()
    outs = [r.process([rec(0, msg, arrow)]), r.process([rec(1, msg, arrow)])]
    outs.append(r.process([rec(2, msg, arrow), rec(3, msg, arrow)]))  # within one batch too
    assert r.stats.duplicates == 3 and r.stats.events == len(msg)
    assert r.contested == {} and not any(o.deadletters for o in outs)


def test_a_re_encoded_repeat_is_no_contradiction_but_a_changed_duration_is() -> None:
    r = router()
    r.process([rec(0, [op(0, T0, 5)])])
    r.process([rec(1, [op(0, T0, 5, algo="ring")])])  # the same op, other bytes
    assert r.contested == {}
    r.process([rec(2, [op(0, T0, 5, exec_us=900.0)])])
    assert "different durations" in r.contested["0xa"][1]


def signed(i: int, events: list[Event], seq: int, ts_us: int) -> Record:
    host = events[0].host
    value = encode_message(events)
    hs = signed_event_headers(host_key(MASTER, host), host, value, fresh=(seq, ts_us))
    return rec(i, events, headers=hs)


def fresh_trust(**kw: Any) -> EventTrust:
    f = Freshness(window_us=120 * S, max_age_us=3600 * S, ahead_us=600 * S,
                  epoch=lambda: T0 / 1e6 + 60)  # fmt: skip
    return EventTrust([MASTER], f, **kw)


def test_a_replayed_signed_message_is_refused_before_corroboration() -> None:
    # dedup_messages=1: the digest of the first message is forgotten, its seq is not
    r = router(trust=fresh_trust(), dedup_messages=1)
    first = signed(0, [op(0, T0, 10)], seq=1, ts_us=T0)
    out = r.process([first, signed(1, [op(0, T0 + S, 11)], seq=2, ts_us=T0 + S)])
    assert out.deadletters == []
    # re-sent later into the same job: its old counters would contest the communicator
    out = r.process([dataclasses.replace(first, offset=2)])
    (dl,) = out.deadletters
    assert dl.reason == "refused: replayed: node-0 already sent message seq 1"
    assert r.contested == {} and r.stats.events == 2


def test_a_stale_signed_message_is_refused() -> None:
    r = router(trust=fresh_trust())
    r.process([signed(0, [op(0, T0 + 200 * S, 10)], seq=5, ts_us=T0 + 50 * S)])
    out = r.process([signed(1, [op(0, T0 + 200 * S, 11)], seq=3, ts_us=T0 - 100 * S)])
    (dl,) = out.deadletters
    assert dl.reason.startswith("refused: stale: node-0 signed this message 150 s before")


def test_an_exact_repeat_of_a_signed_message_is_dropped_not_dead_lettered() -> None:
    r = router(trust=fresh_trust())
    m = signed(0, [op(0, T0, 10)], seq=1, ts_us=T0)
    out = r.process([m, dataclasses.replace(m, offset=1)])
    assert out.deadletters == [] and r.stats.duplicates == 1


def test_signed_messages_must_carry_their_freshness_when_required() -> None:
    r = router(trust=fresh_trust(require_fresh=True))
    value = encode_message([op(0, T0, 10)])
    hs = signed_event_headers(host_key(MASTER, "node-0"), "node-0", value)
    (dl,) = r.process([rec(0, [op(0, T0, 10)], headers=hs)]).deadletters
    assert dl.reason.startswith("refused: no c4-fresh header")
    # a fresh header added to a v1-signed message breaks its signature
    hs2 = [*hs, ("c4-fresh", b"1.%d" % T0)]
    (dl,) = r.process([rec(1, [op(0, T0, 10)], headers=hs2)]).deadletters
    assert dl.reason.startswith("refused: bad signature")


class _Accuser:
    """A detector that accuses node-9 of a hang on every batch, with a rank table."""

    def __init__(self, hosts: list[str]) -> None:
        self.ranks = type("T", (), {"_host_ix": {h: i for i, h in enumerate(hosts)}, "n": 0})()

    def observe(self, cols):
        events = cols.to_events()
        return [Verdict(id="v", ts_us=events[-1].ts_us, job=events[0].job, comm=events[0].comm,
                        host="node-9", fault="noncomm_hang", score=0.9, reason="never joined",
                        window_start_us=0, window_end_us=1)]  # fmt: skip

    def advance(self, now_us):
        return []

    def to_bytes(self):
        return b""


class _Engine:
    def new_detector(self, comm):
        return _Accuser(["node-9", "node-1"])


def accusing_router(wall: list[float], **kw: Any) -> CommRouter:
    return CommRouter(_Engine(), lambda k: None, checkpoint_every_events=10**9,  # type: ignore[arg-type]
                      checkpoint_every_s=1e9, advance_every_us=250_000,
                      epoch=lambda: T0 / 1e6 + 60, clock=lambda: wall[0],
                      limits=EdgeLimits(**kw))  # fmt: skip


def hb(rank: int, started: int, ts: int, comm: str = "0xa", job: str = "j") -> ProgressEvent:
    return ProgressEvent(v=1, job=job, comm=comm, nranks=4, rank=rank, host=f"node-{rank}",
                         ts_us=ts, started=started, completed=started)  # fmt: skip


def test_a_communicator_nobody_corroborates_is_alert_only() -> None:
    wall = [0.0]
    r = accusing_router(wall)
    (v,) = r.process([rec(0, [hb(1, 10, T0, job="invented")])], settle=[0]).verdicts
    assert v.benign and v.reason.startswith(
        "not corroborated (communicator 0xa of job invented: the only one of the job in "
        "which this worker saw node-9); alert only."
    )
    assert r.stats.uncorroborated == 1
    # a second communicator of the job with the accused host in it corroborates
    r.process([rec(1, [hb(1, 10, T0, comm="0xb", job="invented")])], settle=[0])
    out = r.process([rec(2, [hb(1, 11, T0 + S, job="invented")])], settle=[0])
    assert out.verdicts and not any(v.benign for v in out.verdicts)
    loose = accusing_router(wall, isolate_uncorroborated=True)
    (v,) = loose.process([rec(0, [hb(1, 10, T0)])], settle=[0]).verdicts
    assert not v.benign


def test_a_contest_hold_runs_on_the_worker_clock_and_expires() -> None:
    wall = [0.0]
    r = accusing_router(wall, isolate_uncorroborated=True)
    # two sources for rank 1 (its counter goes back): contested for 120 s of wall time
    out = r.process([rec(0, [hb(1, 13, T0)]), rec(1, [hb(1, 11, T0 + S)])], settle=[0])
    assert out.verdicts and all(v.benign for v in out.verdicts)
    assert "evidence contested" in out.verdicts[-1].reason
    wall[0] = 100.0  # event time far on does not end it (a replay's old ts_us neither)
    out = r.process([rec(2, [hb(1, 14, T0 + 500 * S)])], settle=[0])
    assert all(v.benign for v in out.verdicts)
    wall[0] = 121.0
    out = r.process([rec(3, [hb(1, 15, T0 + 501 * S)])], settle=[0])
    assert out.verdicts and not any(v.benign for v in out.verdicts)


@pytest.mark.parametrize("arrow", [False, True], ids=["json", "arrow"])
def test_an_op_cannot_outlast_the_time_since_its_predecessor(arrow: bool) -> None:
    """The poisoned normal: ops claiming exec_us = 1e15 are refused at admission when
    their rank's previous op completed just before; long ops that fit are admitted."""
    r = router()
    r.process([rec(0, [op(q % 4, T0 + q * 10_000, q // 4) for q in range(40)], arrow)])
    r.close_slices()  # judged: the rank table knows each rank's last op
    poison = [op(0, T0 + 500_000, 100, exec_us=1e15, op="AllGather")]
    (dl,) = r.process([rec(1, poison, arrow)]).deadletters
    assert "exec_us 1e+15 is longer than the 0.140 s since rank 0's previous op" in dl.reason
    fits = [op(1, T0 + 3 * S, 11, exec_us=2.5e6)]  # 2.5 s, 2.61 s after its predecessor
    assert r.process([rec(2, fits, arrow)]).deadletters == []


def held_by(table: dict[bytes, bytes], wall: list[float], **kw: Any) -> CommRouter:
    """A router whose checkpoints go to ``table`` and whose wall clock is ``wall[0]``;
    ``kw``: the :class:`EdgeLimits` (and ``forget_lane_s``)."""
    forget = kw.pop("forget_lane_s", 3600.0)
    return CommRouter(CoreEngine(), table.get, checkpoint_every_events=10**9,
                      checkpoint_every_s=1e9, advance_every_us=250_000, clock=lambda: wall[0],
                      epoch=lambda: T0 / 1e6 + 60, forget_lane_s=forget,
                      limits=EdgeLimits(**kw))  # fmt: skip


def test_idle_lanes_beyond_the_cap_are_checkpointed_evicted_and_restored() -> None:
    table: dict[bytes, bytes] = {}
    wall = [0.0]
    r = held_by(table, wall, max_comms=3, evict_idle_s=10.0)

    def speak(i: int, seq: int = 1) -> None:
        r.process([rec(i, [op(k, T0 + i * S, seq, comm=f"0x{i}", job=f"j{i}") for k in range(4)])])
        out = r.tick()  # (a lane's activity is noted by the tick after its messages)
        table.update({k: v for _, k, v in out.checkpoints})

    for i in range(3):
        speak(i)
    assert r.stats.evicted == 0  # at the cap, not over it
    wall[0] = 5.0
    speak(1, 2)  # 0x0 is now the least recently active, 0x2 the most
    wall[0] = 12.0  # 0x0 quiet for 12 s and 0x2 for 12 s, 0x1 for 7 s
    speak(3)
    speak(4)
    # over the cap twice: the idle ones went, least recent first; 0x1 (active) stayed
    assert r.stats.evicted == 2 and sorted(r.comms) == ["0x1", "0x3", "0x4"]
    assert r.stats.evicted_active == 0
    assert sorted(table) == [b"0x0", b"0x2"]
    r.process([rec(9, [op(0, T0 + 9 * S, 2, comm="0x0", job="j0")])])  # it speaks again
    assert "0x0" in r.comms and r.stats.restored == 1


def test_over_the_cap_with_nothing_idle_the_least_recent_go_anyway(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A flood of new ids faster than ``max_comms / evict_idle_s``: nothing is idle yet,
    and still the worker holds at most its cap after a tick (least recently active
    first, checkpointed, restorable), never a lane whose events wait to be judged; the
    warning comes once a minute, not every tick."""
    table: dict[bytes, bytes] = {}
    wall = [0.0]
    r = held_by(table, wall, max_comms=3, evict_idle_s=60.0)
    held = []
    for i in range(12):
        r.process([rec(i, [op(k, T0 + i * S, 1, comm=f"0x{i}", job=f"j{i}") for k in range(4)])])
        out = r.tick()
        table.update({k: v for _, k, v in out.checkpoints})
        held.append(sorted(r.comms))
        wall[0] += 1.0
    # at most the cap after every tick, the newest (its slice is open) always among them
    assert all(len(h) <= 3 and f"0x{i}" in h for i, h in enumerate(held))
    assert r.stats.evicted == 12 - len(r.comms) and r.stats.evicted_active == r.stats.evicted
    assert sorted(table) == sorted(f"0x{i}".encode() for i in range(12) if f"0x{i}" not in r.comms)
    warned = [m for m in caplog.messages if "none idle" in m]
    assert len(warned) == 1 and "evicted" in warned[0]
    r.process([rec(20, [op(0, T0 + 20 * S, 2, comm="0x0", job="j0")])])  # it speaks again
    assert "0x0" in r.comms and r.stats.restored == 1


def test_a_finished_jobs_state_leaves_memory_and_its_series_the_registry() -> None:
    """A lane quiet for ``forget_lane_s`` is evicted whole (checkpointed, restorable), so
    a finished job's communicators are not pinned under the cap for ever; its job leaves
    ``jobs`` with its last lane, and its per-job metric series go with it."""
    from c4base.metrics import Metrics
    from streams.app.agents import _Meter

    table: dict[bytes, bytes] = {}
    wall = [0.0]
    r = held_by(table, wall, forget_lane_s=100.0)
    m = Metrics()
    meter = _Meter(m)
    for i in range(3):
        r.process([rec(i, [op(k, T0 + i * S, 1, comm=f"0x{i}", job=f"j{i}") for k in range(4)])])
        table.update({k: v for _, k, v in r.tick().checkpoints})
    meter.jobs(r.jobs)
    meter.state(r, r.jobs)
    assert b'job="j0"' in m.render()
    wall[0] = 50.0
    r.process([rec(5, [op(k, T0 + 5 * S, 2, comm="0x2", job="j2") for k in range(4)])])
    table.update({k: v for _, k, v in r.tick().checkpoints})
    wall[0] = 120.0  # j0 and j1 quiet for 120 s, j2 for 70
    table.update({k: v for _, k, v in r.tick().checkpoints})
    assert sorted(r.comms) == ["0x2"] and r.jobs == {"j2"} and sorted(r.by_lane) == [(0, "j2")]
    assert sorted(table) == [b"0x0", b"0x1"] and r.stats.evicted == 2
    meter.state(r, r.jobs)
    text = m.render()
    assert b'job="j0"' not in text and b'job="j2"' in text
    assert b'c4stream_held{kind="communicators",stage="worker"} 1.0' in text
    assert b'c4stream_evicted_total{stage="worker",when="idle"} 2.0' in text
    r.process([rec(9, [op(0, T0 + 9 * S, 2, comm="0x0", job="j0")])])  # the job is back
    assert "0x0" in r.comms and r.stats.restored == 1 and "j0" in r.jobs


def test_checkpoints_of_communicators_not_held_are_bounded_too() -> None:
    """Evicted state is checkpointed, so the table (memory, in Faust's memory store)
    would grow with every id ever seen: beyond ``max_checkpoints`` of communicators not
    held, the longest kept are deleted; what a restarted worker recovers counts."""
    table: dict[bytes, bytes] = {}
    wall = [0.0]
    r = held_by(table, wall, max_comms=2, evict_idle_s=60.0, max_checkpoints=3)

    def apply(out: Any) -> None:
        table.update({k: v for _, k, v in out.checkpoints})
        for _, k in out.forgotten:
            del table[k]

    for i in range(8):
        r.process([rec(i, [op(k, T0 + i * S, 1, comm=f"0x{i}", job=f"j{i}") for k in range(4)])])
        apply(r.tick())
        wall[0] += 1.0
        assert len(table) <= 3 + 2 and r.parked <= 3
    assert sorted(r.comms) == ["0x6", "0x7"] and sorted(table) == [b"0x3", b"0x4", b"0x5"]
    assert r.stats.forgotten == 3 and r.stats.evicted == 6
    r.process([rec(9, [op(0, T0 + 9 * S, 2, comm="0x4", job="j4")])])  # back: restored
    assert r.stats.restored == 1 and r.parked == 2
    r.process([rec(10, [op(0, T0 + 10 * S, 2, comm="0x0", job="j0")])])  # forgotten: afresh
    assert r.stats.restored == 1 and r.stats.created == 9
    # a restarted worker: what it recovers is counted, the longest kept deleted first
    r2 = held_by(table, [0.0], max_checkpoints=1)
    out = r2.park([(0, k) for k in [b"0x3", b"0x4", b"0x5"]])
    assert out.forgotten == [(0, b"0x3"), (0, b"0x4")] and r2.parked == 1


def test_a_snapshot_header_is_inside_the_signature() -> None:
    """A Flight Recorder snapshot's header (its id, part and the dumps' facts) decides how
    the worker judges the message, so signing covers it: changed, added or taken off, the
    signature fails."""
    from c4base.signing import SNAPSHOT_HEADER, host_key, signed_event_headers
    from streams.app.deadletter import Record

    trust = EventTrust([MASTER])
    value = b"[]"
    snap = b'{"v":1,"id":"s","part":0,"parts":1}'
    hs = dict(signed_event_headers(host_key(MASTER, "node-001"), "node-001", value,
                                   [(SNAPSHOT_HEADER, snap)], fresh=(1, 2)))  # fmt: skip

    def rec(snapshot: bytes | None) -> Record:
        return Record("ev", 0, 0, None, value, signer=hs["c4-host"],
                      signature=hs["c4-sig"], fresh=hs["c4-fresh"], snapshot=snapshot)  # fmt: skip

    assert trust.of(rec(snap)) is None
    for other in (snap.replace(b'"s"', b'"t"'), None):
        assert "bad signature" in (trust.of(rec(other)) or "")


def test_a_replay_after_a_restart_is_still_refused() -> None:
    """The sequence numbers a worker accepted are checkpointed with its partition: the
    worker that restarts (or takes the partition over) refuses a replay within the
    freshness window; the same record read again at its own offset is no replay."""
    table: dict[bytes, bytes] = {}

    def worker() -> CommRouter:
        return CommRouter(CoreEngine(), table.get, checkpoint_every_events=10**9,
                          checkpoint_every_s=1e9, advance_every_us=250_000,
                          clock=lambda: 0.0, epoch=lambda: T0 / 1e6 + 60,
                          trust=fresh_trust())  # fmt: skip

    r = worker()
    first = signed(0, [op(0, T0, 10)], seq=1, ts_us=T0)
    assert r.process([first]).deadletters == []
    table.update({k: v for _, k, v in r.flush(drop=True).checkpoints})  # a clean stop
    r2 = worker()
    out = r2.process([dataclasses.replace(first, offset=7)])  # captured, re-sent
    (dl,) = out.deadletters
    assert dl.reason == "refused: replayed: node-0 already sent message seq 1"
    assert r2.stats.events == 0 and r2.stats.restored == 0  # (no detector restored)
    assert r2.process([first]).deadletters == []  # redelivered at its offset: read again


class _Isolates:
    """A host correlator that isolates the host of every verdict it observes."""

    def observe(self, v: Verdict) -> list:
        from streams.commands import IsolationCommand

        return [IsolationCommand(id=v.id, ts_us=v.ts_us, job=v.job, host=v.host, fault=v.fault,
                                 action="cordon_and_taint", confidence=1.0, reason="slow.",
                                 evidence={})]  # fmt: skip

    def advance(self, now_us: int, job: str) -> list:
        return []

    def to_bytes(self) -> bytes:
        return b""


class _CorEngine:
    def new_correlator(self) -> _Isolates:
        return _Isolates()

    def load_correlator(self, data: bytes) -> _Isolates:
        return _Isolates()


def test_the_rails_across_jobs_hold_after_a_restart() -> None:
    """A host isolated for one job is not isolated for another within the cool-down,
    nor beyond the cap per hour, by a worker restarted in between: the rails are
    checkpointed with their verdicts partition's correlator."""
    from streams.app.correlate_runner import CorrelatorRunner, HostRails
    from streams.verdicts import encode_verdict

    table: dict[bytes, bytes] = {}
    wall, epoch = [1000.0], [1.8e9]

    def worker() -> CorrelatorRunner:
        rails = HostRails(2, 600.0, clock=lambda: wall[0], epoch=lambda: epoch[0])
        return CorrelatorRunner(_CorEngine(), table.get, checkpoint_every_events=10**9,  # type: ignore[arg-type]
                                checkpoint_every_s=1e9, watermark_topic="wm",
                                clock=lambda: wall[0], host_rails=rails)  # fmt: skip

    def verdict(i: int, job: str, host: str) -> Record:
        v = Verdict(id=f"v{i}", ts_us=T0, job=job, comm="c", host=host, fault="straggler",
                    score=0.9, reason="slow", window_start_us=0, window_end_us=1)  # fmt: skip
        return Record("v", 0, i, None, encode_verdict(v), T0)

    r = worker()
    r.process([verdict(0, "a", "node-1"), verdict(1, "b", "node-2")])
    out = r.flush()  # a clean stop judges what it holds (a revoke hands it off)
    assert [c.action for c in out.commands] == ["cordon_and_taint"] * 2
    table.update({k: v for _, k, v in out.checkpoints})
    wall[0], epoch[0] = 1.0, epoch[0] + 30  # 30 s on; a new process's monotonic clock
    r2 = worker()
    r2.process([verdict(2, "c", "node-1"), verdict(3, "d", "node-3")])
    c1, c3 = r2.flush().commands
    assert c1.action == c3.action == "alert_only"
    assert "node-1 was isolated for job a" in c1.reason
    assert "2 isolating commands in the last hour across all jobs (cap 2" in c3.reason


class _Learns:
    """A detector with a real rank table (identities learned from its events) that
    accuses ``host`` of a hang on every batch."""

    def __init__(self, host: str) -> None:
        from streams.core.ranks import RankTable

        self.ranks, self.host = RankTable(0), host

    def observe(self, cols):
        events = cols.to_events()
        for e in events:
            self.ranks.grow(e.nranks)
            self.ranks.learn_identity(e.rank, e.host, e.gpu, e.nic)
        return [Verdict(id="v", ts_us=events[-1].ts_us, job=events[0].job, comm=events[0].comm,
                        host=self.host, fault="noncomm_hang", score=0.9, reason="hung",
                        window_start_us=0, window_end_us=1)]  # fmt: skip

    def advance(self, now_us):
        return []

    def to_bytes(self):
        return b""


class _LearnsEngine:
    def new_detector(self, comm):
        return _Learns("node-1")


def test_a_forged_communicator_inside_a_known_job_is_alert_only() -> None:
    """Signing off: a forger invents communicator 0xf inside a real job, naming real
    processes of it (node-k's GPU 0) and accusing node-1. The job is split two GPUs per
    node (tensor parallel) inside a world communicator of 8 ranks: four ranks one per
    node is no shape of the job, nor all of its processes, so 0xf is alert-only; the
    real communicators' verdicts still isolate."""
    r = CommRouter(_LearnsEngine(), lambda k: None, checkpoint_every_events=10**9,  # type: ignore[arg-type]
                   checkpoint_every_s=1e9, advance_every_us=250_000,
                   epoch=lambda: T0 / 1e6 + 60, clock=lambda: 0.0)  # fmt: skip

    def ev(comm: str, rank: int, n: int, host: str, gpu: int, t: int) -> ProgressEvent:
        return ProgressEvent(v=1, job="train", comm=comm, nranks=n, rank=rank, host=host,
                             gpu=gpu, ts_us=T0 + t * S, started=t, completed=t)  # fmt: skip

    def messages(t: int) -> list[Record]:
        world = [ev("0xw", 2 * k + g, 8, f"node-{k}", g, t) for k in range(4) for g in range(2)]
        tp = [[ev(f"0xt{k}", g, 2, f"node-{k}", g, t) for g in range(2)] for k in range(4)]
        forged = [ev("0xf", k, 4, f"node-{k}", 0, t) for k in range(4)]
        return [rec(10 * t + i, m) for i, m in enumerate([world, *tp, forged])]

    r.process(messages(1), settle=[0])  # (each communicator's first batch: learned)
    r.stats.uncorroborated = 0
    out = r.process(messages(2), settle=[0])
    by_comm = {v.comm: v for v in out.verdicts}
    assert (
        by_comm["0xf"].benign
        and "its shape (4 ranks, 1/1/1/1 per host) is that of no other communicator of the job"
        in by_comm["0xf"].reason
    )
    assert not by_comm["0xt1"].benign and not by_comm["0xw"].benign
    assert r.stats.uncorroborated == 4  # 0xf, and the TP groups of nodes 0, 2, 3 (none on node-1)
