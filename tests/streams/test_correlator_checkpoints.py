"""The correlator's checkpoint per job (issue 22): a verdicts partition's correlator
writes one record per job, only for the jobs whose state changed; a restarted one reads
each job's back when it meets the job and decides as an uninterrupted one; the form
before (one record per partition, schema 2) is read once and moved to per-job records;
a record of another job under a job's key is refused with the reason."""

from __future__ import annotations

import msgspec
import pytest

from producers.simulator import FaultSpec, SimConfig, simulate
from streams.app.correlate_runner import CorrelatorRunner
from streams.app.deadletter import Record
from streams.app.engine import CoreEngine
from streams.app.watermark import Watermark, encode_watermark
from streams.core import DetectionPipeline, HostCorrelator, PolicyConfig
from streams.core import checkpoint as ck
from streams.verdicts import Verdict, encode_verdict

JOBS = {
    "job-a": FaultSpec(kind="straggler", host=1, gpu=2, start_s=4, severity=1.6),
    "job-b": FaultSpec(kind="rank_hang", host=2, gpu=1, start_s=8),
}


@pytest.fixture(scope="module")
def verdicts() -> list[Verdict]:
    """Two jobs' verdicts as the detectors conclude them, in event time."""
    out: list[Verdict] = []
    for job, fault in JOBS.items():
        cfg = SimConfig(job=job, hosts=4, gpus_per_host=4, tp=4, duration_s=24, seed=7,
                        faults=[fault])  # fmt: skip
        p = DetectionPipeline()
        for b in simulate(cfg):
            p.feed(b)
        p.finish()
        out += p.verdicts
    return sorted(out, key=lambda v: (v.ts_us, not v.benign))


def _runner(table: dict[bytes, bytes]) -> CorrelatorRunner:
    # max_pending=0: each verdict judged as it is read (no watermark needed)
    return CorrelatorRunner(CoreEngine(), table.get, checkpoint_every_events=10**9,
                            checkpoint_every_s=1e9, max_pending=0)  # fmt: skip


def _feed(r: CorrelatorRunner, vs: list[Verdict], table: dict[bytes, bytes], off: int = 0):
    cmds, writes = [], []
    for i, v in enumerate(vs):
        out = r.process([Record("v", 0, off + i, None, encode_verdict(v))])
        assert not out.deadletters, out.deadletters[0].reason
        cmds += out.commands
        writes.append([k for _, k, _ in out.checkpoints])
        table.update({k: b for _, k, b in out.checkpoints})
    return cmds, writes


def _decisions(cmds: list) -> list[tuple]:
    return [(c.job, c.fault, c.host, c.gpu, c.action) for c in cmds]


def test_a_job_part_round_trips_and_replaces_only_that_job(verdicts: list[Verdict]) -> None:
    c = HostCorrelator(PolicyConfig())
    for v in verdicts:
        c.observe(v)
    merged = HostCorrelator(PolicyConfig())
    for job in JOBS:
        HostCorrelator.from_bytes(c.to_bytes(job), PolicyConfig(), merged, job)
    for job in JOBS:
        assert merged.to_bytes(job) == c.to_bytes(job)
        assert len(c.to_bytes(job)) < len(c.to_bytes())
    # a job's part loaded again replaces it (not added: no doubled entries)
    HostCorrelator.from_bytes(c.to_bytes("job-a"), PolicyConfig(), merged, "job-a")
    assert merged.to_bytes("job-a") == c.to_bytes("job-a")
    assert merged.to_bytes("job-b") == c.to_bytes("job-b")
    # another job's record where job-b's is expected, or a whole one: refused, why said
    with pytest.raises(ck.CheckpointError, match="of job 'job-a' where one of job 'job-b'"):
        HostCorrelator.from_bytes(c.to_bytes("job-a"), PolicyConfig(), merged, "job-b")
    with pytest.raises(ck.CheckpointError, match="not of a whole correlator"):
        HostCorrelator.from_bytes(c.to_bytes("job-a"), PolicyConfig())
    # a worker of schema 2 refuses a schema-3 record by its number
    with pytest.raises(ck.CheckpointError, match="schema 3 is newer than this worker's"):
        ck.decode(c.to_bytes("job-a"), "correlator", {2: msgspec.Struct})


def test_checkpoints_are_per_job_and_a_restart_decides_as_if_never_stopped(
    verdicts: list[Verdict],
) -> None:
    whole, _ = _feed(_runner({}), verdicts, {})
    assert {d[:3] for d in _decisions(whole)} >= {
        ("job-a", "straggler", "node-001"), ("job-b", "noncomm_hang", "node-002")
    }  # fmt: skip
    table: dict[bytes, bytes] = {}
    half = len(verdicts) // 2
    r1 = _runner(table)
    first, writes = _feed(r1, verdicts[:half], table)
    # behind each decision only the deciding job's record is written
    keys = {job: r1.key(0, job) for job in JOBS}
    for cmd, w in zip(first, [w for w in writes if w], strict=False):
        assert w == [keys[cmd.job]], (cmd.job, w)
    out = r1.flush(drop=True)  # a clean stop (or revocation): every dirty job written
    table.update({k: b for _, k, b in out.checkpoints})
    assert set(table) == set(keys.values())  # one record per job, none per partition
    r2 = _runner(table)
    second, _ = _feed(r2, verdicts[half:], table, off=half)
    assert r2.stats.restored == 2  # each job read back when first met
    assert _decisions(first + second) == _decisions(whole)


def test_the_form_before_is_read_once_and_moved_to_per_job_records(
    verdicts: list[Verdict],
) -> None:
    half = len(verdicts) // 2
    c = HostCorrelator(PolicyConfig())
    first = [cmd for v in verdicts[:half] for cmd in c.observe(v)]
    body = msgspec.msgpack.decode(c.to_bytes()[4:])[2][:-1]  # schema 2: no job field
    table = {CorrelatorRunner.key(0): ck.MAGIC + msgspec.msgpack.encode(["correlator", 2, body])}
    r = _runner(table)
    out = r.process([Record("v", 0, half, None, encode_verdict(verdicts[half]))])
    keys = [k for _, k, _ in out.checkpoints]
    # each job's part, then an empty correlator under the old key, in that order
    assert keys[-1] == r.key(0) and set(keys[:-1]) == {r.key(0, j) for j in JOBS}
    moved = dict((k, b) for _, k, b in out.checkpoints)
    assert HostCorrelator.from_bytes(moved[r.key(0)], PolicyConfig()).clock == {}
    for job in JOBS:
        assert moved[r.key(0, job)] == c.to_bytes(job)
    table.update(moved)
    second = list(out.commands)
    more, _ = _feed(r, verdicts[half + 1 :], table, off=half + 1)
    whole, _ = _feed(_runner({}), verdicts, {})
    assert _decisions(first + second + more) == _decisions(whole)
    r3 = _runner(table)  # restarted again: the old key holds nothing to move
    out3 = r3.process([Record("v", 0, 10**6, None, encode_verdict(verdicts[-1]))])
    assert r.key(0) not in [k for _, k, _ in out3.checkpoints]


def _holding(table: dict[bytes, bytes], **kw: object) -> CorrelatorRunner:
    """A correlator that holds every verdict (no watermark yet)."""
    return CorrelatorRunner(CoreEngine(), table.get, checkpoint_every_events=10**9,
                            checkpoint_every_s=1e9, watermark_topic="wm", **kw)  # fmt: skip


def _passed(r: CorrelatorRunner, upto: int) -> list:
    """The events partition's clock past every verdict sent up to offset ``upto``: all
    are judged, in order."""
    mark = Watermark(partition=0, clock_us=2**62, verdicts_offset=upto)
    out = r.process([Record("wm", 0, 0, b"0", encode_watermark(mark))])
    return _decisions(out.commands)


def _held(r: CorrelatorRunner, vs: list[Verdict], off: int) -> list[tuple[int, bytes, bytes]]:
    out = r.process([Record("v", 0, off + i, None, encode_verdict(v)) for i, v in enumerate(vs)])
    assert not out.deadletters and not out.commands  # held
    return out.checkpoints


def _revoked(vs: list[Verdict]) -> dict[bytes, bytes]:
    """The table after a correlator held ``vs`` and its partition was revoked."""
    table: dict[bytes, bytes] = {}
    first = _holding(table)
    table.update({k: b for _, k, b in _held(first, vs, 0)})
    revoked = first.flush({0}, drop=True)
    assert not revoked.commands and not revoked.deadletters  # nothing judged early
    table.update({k: b for _, k, b in revoked.checkpoints})
    assert b"held-verdicts-0" in table
    return table


def test_a_revoked_partitions_held_verdicts_are_judged_by_its_next_owner(
    verdicts: list[Verdict],
) -> None:
    """Verdicts held for their watermark when the partition is revoked are handed to the
    next owner, not judged there and then: the two decide as one correlator does."""
    runner, feed = _holding, _held

    def passed(r: CorrelatorRunner) -> list:
        return _passed(r, len(verdicts) - 1)

    one = runner({})
    feed(one, verdicts, 0)
    expected = passed(one)
    assert {d[:2] for d in expected} >= {("job-a", "straggler"), ("job-b", "noncomm_hang")}

    half = len(verdicts) // 2
    table = _revoked(verdicts[:half])
    nxt = runner(table)
    writes = feed(nxt, verdicts[half:], half)
    # taken back once: an empty hand-off is written at once
    assert [k for _, k, _ in writes].count(b"held-verdicts-0") == 1
    table.update({k: b for _, k, b in writes})
    assert passed(nxt) == expected
    assert runner(table).process([]).commands == []  # nothing handed off twice


def test_a_quiet_partition_takes_its_handed_off_verdicts_back_at_assignment(
    verdicts: list[Verdict],
) -> None:
    """The next owner takes the held verdicts back when it is assigned the partition
    (the worker calls ``take_back`` once its tables are recovered), not at the
    partition's next verdict: a partition that gets none holds nothing for ever."""
    n = len(verdicts)  # all read and held by the first owner; none comes after
    alone = _holding({})
    _held(alone, verdicts, 0)
    expected = _passed(alone, n - 1)
    assert {d[:2] for d in expected} >= {("job-a", "straggler"), ("job-b", "noncomm_hang")}
    table = _revoked(verdicts)
    nxt = _holding(table, verdicts_read_from=lambda q: n)
    nxt.take_back({0})  # at assignment: no record of partition 0 read yet
    assert sum(len(h) for h in nxt.pending[0].values()) == n
    writes = nxt.tick().checkpoints  # the emptied hand-off goes out with the next output
    assert [k for _, k, _ in writes].count(b"held-verdicts-0") == 1
    nxt.take_back({0})  # once only
    assert sum(len(h) for h in nxt.pending[0].values()) == n
    assert _passed(nxt, n - 1) == expected
