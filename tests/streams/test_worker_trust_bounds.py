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

    def observe(self, events):
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
        "not corroborated (communicator 0xa is the only one of job invented in which this "
        "worker saw node-9); alert only."
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


def test_idle_lanes_beyond_the_cap_are_checkpointed_evicted_and_restored() -> None:
    table: dict[bytes, bytes] = {}
    wall = [0.0]
    r = CommRouter(CoreEngine(), table.get, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=250_000, clock=lambda: wall[0],
                   epoch=lambda: T0 / 1e6 + 60,
                   limits=EdgeLimits(max_comms=2, evict_idle_s=10.0))  # fmt: skip
    for i in range(4):
        r.process([rec(i, [op(k, T0 + i * S, 1, comm=f"0x{i}", job=f"j{i}") for k in range(4)])])
        r.tick()  # (a lane's activity is noted by the tick after its messages)
        wall[0] += 1.0
    assert r.stats.evicted == 0  # nothing idle for 10 s yet: active state is kept
    wall[0] = 11.5  # 0x0 and 0x1 quiet for over 10 s, 0x2 and 0x3 not yet
    out = r.tick()
    table.update({k: v for _, k, v in out.checkpoints})
    assert r.stats.evicted == 2 and sorted(r.comms) == ["0x2", "0x3"]
    assert sorted(table) == [b"0x0", b"0x1"]
    r.process([rec(9, [op(0, T0 + 9 * S, 2, comm="0x0", job="j0")])])  # it speaks again
    assert "0x0" in r.comms and r.stats.restored == 1
