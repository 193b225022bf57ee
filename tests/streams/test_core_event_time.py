"""Event time per job: the correlator, the offline pipeline and the worker's broker-free
router keep one clock per job, so one job's time never ages out another's evidence; late
data is judged, or reported "late by N s", never dropped in silence."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest

from producers.events import Event, OpEvent, encode_message
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.app.correlate_runner import CorrelatorRunner
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter
from streams.app.engine import CoreEngine
from streams.app.settings import WorkerConfigError, load_worker_config
from streams.app.watermark import Watermark, encode_watermark
from streams.core import (
    DetectionPipeline,
    HostCorrelator,
    PolicyConfig,
    checkpoint,
    correlate_state,
)
from streams.core.columns import EventColumnsLike
from streams.core.correlate import LateEvidence
from streams.verdicts import Verdict, encode_verdict

W = 5_000_000
TEN_MIN = 600_000_000
T0 = 1_750_000_000_000_000


def straggler(job: str, host: str, window: int, t0: int = T0, gpu: int = 3) -> Verdict:
    return Verdict(
        id=f"{job}{host}{window}",
        ts_us=t0 + (window + 1) * W,
        job=job,
        comm=f"0x{job}",
        host=host,
        gpu=gpu,
        fault="straggler",
        score=0.9,
        reason="r",
        window_start_us=t0 + window * W,
        window_end_us=t0 + (window + 1) * W,
        evidence={"collectives": 12, "last_frac": 0.9, "late_ms": 20.0, "comm_hosts": 16},
    )


@pytest.mark.timeout(10)
def test_a_job_ten_minutes_behind_keeps_its_evidence() -> None:
    c = HostCorrelator(PolicyConfig())
    # job "behind" has one window of evidence; then job "ahead", 10 minutes later, goes on
    assert c.observe(straggler("behind", "node-001", 1, T0 - TEN_MIN)) == []
    for w in range(1, 4):
        c.observe(straggler("ahead", "node-009", w, T0, gpu=0))
    c.advance(T0 + 30 * W, "ahead")
    # ...and the second window of "behind" still finds the first one: one command
    [cmd] = c.observe(straggler("behind", "node-001", 2, T0 - TEN_MIN))
    assert (cmd.job, cmd.host, cmd.gpu, cmd.evidence["windows"]) == ("behind", "node-001", 3, 2)
    assert cmd.ts_us == T0 - TEN_MIN + 3 * W  # stamped on its own job's time
    assert c.clock == {"behind": T0 - TEN_MIN + 3 * W, "ahead": T0 + 30 * W}


@pytest.mark.timeout(10)
def test_cool_down_and_cap_run_on_their_own_jobs_clock() -> None:
    c = HostCorrelator(PolicyConfig(cooldown_us=60_000_000))
    cmds = [*c.observe(straggler("a", "node-001", 1)), *c.observe(straggler("a", "node-001", 2))]
    assert len(cmds) == 1
    c.advance(T0 + TEN_MIN, "b")  # another job's time passing does not end a's cool-down
    assert ("a", "node-001") in c.cooldown
    assert c.observe(straggler("a", "node-001", 3)) == []
    c.advance(T0 + 3 * W + 61_000_000, "a")  # a's own time does
    assert ("a", "node-001") not in c.cooldown
    assert c.observe(straggler("a", "node-001", 20)) == []  # one window is not enough
    assert [x.host for x in c.observe(straggler("a", "node-001", 21))] == ["node-001"]


@pytest.mark.timeout(10)
def test_late_verdicts_within_the_allowed_lateness_are_judged_beyond_it_reported() -> None:
    cfg = PolicyConfig(allowed_lateness_us=10_000_000)
    c = HostCorrelator(cfg)
    c.advance(T0 + 4 * W, "j")  # j's clock at window 3's end
    assert c.observe(straggler("j", "node-001", 2)) == []  # 5 s behind: judged
    [cmd] = c.observe(straggler("j", "node-001", 3))
    assert cmd.host == "node-001"
    with pytest.raises(LateEvidence, match=r"^late by 15 s: job j's correlator clock") as err:
        c.observe(straggler("j", "node-002", 0))  # 15 s behind
    assert (err.value.job, err.value.late_us) == ("j", 15_000_000)
    assert ("j", "node-002", "straggler") not in c.episodes  # nothing half-taken
    with pytest.raises(ValueError, match="allowed_lateness_us"):
        HostCorrelator(PolicyConfig(allowed_lateness_us=20_000_000))


@pytest.mark.timeout(10)
def test_per_job_clocks_survive_a_checkpoint_and_an_old_checkpoint_is_read() -> None:
    c = HostCorrelator(PolicyConfig())
    c.observe(straggler("a", "node-001", 1))
    c.observe(straggler("b", "node-001", 1, T0 - TEN_MIN))
    back = HostCorrelator.from_bytes(c.to_bytes(), PolicyConfig())
    assert back.clock == c.clock and back.now == T0 + 2 * W
    # a checkpoint written before per-job clocks had one "now" for everything
    state = msgspec.structs.replace(correlate_state.state_of(c), clock={})
    old = HostCorrelator.from_bytes(
        checkpoint.encode("correlator", correlate_state.SCHEMA, state), PolicyConfig()
    )
    assert old.clock == {"a": T0 + 2 * W, "b": T0 + 2 * W}


def sim_trace(sim: object, shift: int = 0) -> list[list[Event]]:
    out = [b for b in simulate(sim) if b]  # type: ignore[arg-type]
    return [[msgspec.structs.replace(e, ts_us=e.ts_us + shift) for e in b] for b in out]


HANG = msgspec.structs.replace(
    SCENARIOS["rank_hang"],
    job="job-hang",
    hosts=4,
    duration_s=25,
    faults=[FaultSpec(kind="rank_hang", host=2, gpu=1, start_s=15)],
)
SLOW = msgspec.structs.replace(
    SCENARIOS["straggler"],
    job="job-slow",
    hosts=4,
    duration_s=30,
    faults=[FaultSpec(kind="straggler", host=1, gpu=5, start_s=10, severity=1.3)],
)


def run(batches: list[list[Event]]) -> DetectionPipeline:
    p = DetectionPipeline()
    for b in batches:
        p.feed(b)
    p.finish()
    return p


@pytest.mark.timeout(60)
def test_pipeline_judges_two_jobs_ten_minutes_apart_each_on_its_own_time() -> None:
    a, b = sim_trace(HANG), sim_trace(SLOW, -TEN_MIN)
    alone = sorted(c.id for c in run(a).commands + run(b).commands)
    both = [x for pair in itertools.zip_longest(a, b) for x in pair if x]
    p = run(both)
    assert sorted(c.id for c in p.commands) == alone and len(alone) == 2
    assert sorted((c.job, c.host, c.gpu) for c in p.commands) == [
        ("job-hang", "node-002", 1),
        ("job-slow", "node-001", 5),
    ]
    assert p.late == []
    # one after the other (a replay of an older trace after a newer one): the same
    assert sorted(c.id for c in run(a + b).commands) == alone


class _Recorder:
    def __init__(self, log: list, comm: str) -> None:
        self.log, self.comm = log, comm

    def observe(self, cols: EventColumnsLike) -> list[Verdict]:
        events = cols.to_events()
        self.log.append(("observe", self.comm, [e.ts_us for e in events]))
        return []

    def advance(self, now_us: int) -> list[Verdict]:
        self.log.append(("advance", self.comm, now_us))
        return []

    def to_bytes(self) -> bytes:
        return b"state"


class _RecorderEngine:
    def __init__(self) -> None:
        self.log: list = []

    def new_detector(self, comm: str) -> _Recorder:
        return _Recorder(self.log, comm)

    def load_detector(self, comm: str, data: bytes) -> _Recorder:
        return _Recorder(self.log, comm)


def ev(job: str, comm: str, ts_us: int) -> OpEvent:
    return OpEvent(v=1, job=job, comm=comm, nranks=2, rank=0, host="h", ts_us=ts_us,
                   op="AllReduce", seq=ts_us, bytes=1, exec_us=1.0)  # fmt: skip


def test_router_advances_each_job_by_its_own_clock_and_dead_letters_late_messages() -> None:
    eng = _RecorderEngine()
    r = CommRouter(eng, lambda k: None, checkpoint_every_events=10**9, checkpoint_every_s=1e9,
                   advance_every_us=1_000_000, allowed_lateness_us=10_000_000)  # fmt: skip
    ahead, behind = T0, T0 - TEN_MIN
    recs = [
        Record("ev", 0, i, b"k", encode_message([ev(job, comm, t)]))
        for i, (job, comm, t) in enumerate(
            [
                ("a", "0xa", ahead),
                ("b", "0xb", behind),
                ("a", "0xa", ahead + 1_500_000),
                ("b", "0xb", behind + 1_500_000),
            ]
        )
    ]
    out = r.process(recs)
    adv = {(c, t) for kind, c, t in eng.log if kind == "advance"}
    assert adv == {("0xa", ahead), ("0xb", behind)}  # never b to a's time
    assert r.clock_us == {(0, "a"): ahead + 1_500_000, (0, "b"): behind + 1_500_000}
    assert out.deadletters == [] and r.late_events == {}
    # 0xa is judged up to ahead + 1.5 s (once its slice closes); a message 20 s older:
    r.close_slices()
    late = Record("ev", 0, 9, b"k", encode_message([ev("a", "0xa", ahead - 18_500_000)] * 3))
    out = r.process([late])
    [dl] = out.deadletters
    assert dl.reason.startswith("late by 20 s: communicator 0xa of job a was already judged")
    assert dl.source == "ev[0]@9" and r.late_events == {"a": 3} and out.late_events == [("a", 3)]
    # within the allowed lateness: taken and judged
    ok = Record("ev", 0, 10, b"k", encode_message([ev("a", "0xa", ahead - 5_000_000)]))
    assert r.process([ok]).deadletters == []
    r.close_slices()
    assert ("observe", "0xa", [ahead - 5_000_000]) in eng.log


def wm(p: int, t: int, job: str | None, offset: int = 0, **kw: object) -> Record:
    return Record("wm", 0, offset, None,
                  encode_watermark(Watermark(partition=p, clock_us=t, job=job, **kw)))  # fmt: skip


def test_each_job_is_held_by_its_own_watermark_and_late_verdicts_are_counted() -> None:
    wall = [100.0]
    c = CorrelatorRunner(CoreEngine(), lambda k: None, checkpoint_every_events=10**9,
                         checkpoint_every_s=1e9, watermark_topic="wm", events_partitions=2,
                         idle_s=5.0, max_hold_s=30.0, clock=lambda: wall[0])  # fmt: skip
    c.process([wm(0, T0, "a"), wm(0, T0 - TEN_MIN, "b"), wm(1, T0 + W, "a")])
    assert c.watermark(wall[0], 0, "a") == T0
    assert c.watermark(wall[0], 0, "b") is None  # 1 lags: its backlog may hold some of b
    c.process([wm(1, T0 + W, "a", caught_up=True)])
    assert c.watermark(wall[0], 0, "b") is None  # "caught up" may be a fetch behind...
    wall[0] += 5.0
    c.process([wm(1, T0 + W, "a", caught_up=True)])
    assert c.watermark(wall[0], 0, "b") == T0 - TEN_MIN  # ...but not for idle_s: nothing of b
    c.process([wm(0, T0, "a"), wm(0, T0 - TEN_MIN, "b")])  # 0 reports again (lagging)
    # b's verdicts are released by b's watermark, not held behind a's clock or vice versa
    vb = straggler("b", "node-001", 0, T0 - TEN_MIN - 5 * W)
    c.process([Record("v", 0, 1, None, encode_verdict(vb), vb.ts_us)])
    assert c.pending[0]["b"] == []
    va = straggler("a", "node-002", 0, T0)
    c.process([Record("v", 0, 2, None, encode_verdict(va), va.ts_us)])
    assert len(c.pending[0]["a"]) == 1  # a is held: partition 0 is only at T0
    # a verdict of b far behind b's clock: dead-lettered "late by", counted per job
    c.process([wm(0, T0 - TEN_MIN + 60_000_000, "b")])
    old = straggler("b", "node-003", 0, T0 - TEN_MIN)
    out = c.process([Record("v", 0, 3, None, encode_verdict(old), old.ts_us)])
    [dl] = out.deadletters
    assert dl.reason.startswith("late by 55 s: job b's correlator clock")
    assert c.late_verdicts == {"b": {"deadlettered": 1}}
    assert out.late_verdicts == [("b", "deadlettered")]
    assert c.describe()["0"]["jobs"]["a"]["holding"] == [0]  # 1: idle for idle_s


@pytest.mark.timeout(60)
def test_one_hosts_backlog_is_counted_late_offline_and_dead_lettered_alike_by_the_worker() -> None:
    """Host node-002's exporter is cut off from 10 s to 40 s while the rest of its job
    goes on; its backlog then arrives. What is more than the allowed lateness behind its
    communicators cannot be judged: counted (offline) / dead-lettered (worker), the same."""
    sim = msgspec.structs.replace(HANG, duration_s=50, faults=[])
    full = sim_trace(sim)
    cut = [b for b in full if b[0].host == "node-002" and T0 + 10e6 <= b[0].ts_us < T0 + 40e6]
    rest = [b for b in full if b not in cut]
    stream = [b for b in rest if b[0].ts_us < T0 + 40e6] + cut
    stream += [b for b in rest if b[0].ts_us >= T0 + 40e6]
    p = run(stream)
    total = sum(map(len, full))
    late = sum(n for _, _, n, _ in p.late_events)
    assert late > 0 and p.n_events + late == total  # every event judged or counted
    assert all(by > 10_000_000 for *_, by in p.late_events)
    assert {job for job, *_ in p.late_events} == {"job-hang"}
    cut_comms = {b[0].comm for b in cut}
    assert {comm for _, comm, _, _ in p.late_events} <= cut_comms

    r = CommRouter(CoreEngine(), lambda k: None, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=500_000)  # fmt: skip
    recs = [Record("ev", 0, i, None, encode_message(b)) for i, b in enumerate(stream)]
    letters = []
    for i in range(0, len(recs), 50):
        letters += r.process(recs[i : i + 50]).deadletters
    letters += r.close_slices().deadletters
    assert all(d.reason.startswith("late by ") for d in letters)
    assert r.late_events == {"job-hang": late}
    assert len(letters) == len(p.late_events)


def test_an_allowed_lateness_beyond_what_the_notes_cover_is_refused_when_the_file_is_read(
    tmp_path: Path,
) -> None:
    f = tmp_path / "c4stream.toml"
    f.write_text("[worker.policy]\nallowed_lateness_us = 20000000\n")
    with pytest.raises(
        WorkerConfigError, match=r"<= 15000000 - at `\$(.policy)?.allowed_lateness_us`"
    ):
        load_worker_config(f)
    f.write_text("[worker.policy]\nallowed_lateness_us = 5000000\n")
    assert load_worker_config(f).policy.allowed_lateness_us == 5_000_000


def test_a_finished_jobs_lane_is_forgotten_and_comes_back_with_new_events() -> None:
    wall = [0.0]
    eng = _RecorderEngine()
    r = CommRouter(
        eng,
        lambda k: None,
        checkpoint_every_events=10**9,
        checkpoint_every_s=1e9,
        advance_every_us=1_000_000,
        forget_lane_s=60.0,
        clock=lambda: wall[0],
    )
    r.process([Record("ev", 0, 0, b"k", encode_message([ev("a", "0xa", T0)]))])
    r.process([Record("ev", 0, 1, b"k", encode_message([ev("b", "0xb", T0)]))])
    r.tick()
    wall[0] += 30.0
    r.process([Record("ev", 0, 2, b"k", encode_message([ev("b", "0xb", T0 + 2_000_000)]))])
    r.tick()
    wall[0] += 40.0  # a quiet for 70 s, b for 40 s
    r.tick()
    assert set(r.clock_us) == {(0, "b")}
    r.process([Record("ev", 0, 3, b"k", encode_message([ev("a", "0xa", T0 + 9_000_000)]))])
    assert r.clock_us[(0, "a")] == T0 + 9_000_000  # the job is back: its lane starts again
    r.close_slices()
    assert ("advance", "0xa", T0 + 9_000_000) in eng.log  # and its communicator with it


def test_the_correlator_forgets_the_marks_of_a_finished_job() -> None:
    wall = [0.0]
    c = CorrelatorRunner(
        CoreEngine(),
        lambda k: None,
        checkpoint_every_events=10**9,
        checkpoint_every_s=1e9,
        watermark_topic="wm",
        events_partitions=1,
        forget_lane_s=60.0,
        clock=lambda: wall[0],
    )
    c.process([wm(0, T0, "a", caught_up=True), wm(0, T0, "b", caught_up=True)])
    wall[0] += 61.0
    c.process([wm(0, T0 + W, "b", caught_up=True)])
    c.tick()
    assert set(c.lanes[0]) == {(0, "b")}
    assert c.watermark(wall[0], 0, "b") == T0 + W
