"""The exporter following a Flight Recorder dump directory: a dump is published once it
is whole, with the time the exporter first saw it as its dump time, so the consumer can
isolate a hang that a copied directory (mtimes lost) can only alert about.

Dumps are the committed real gloo captures (torch 2.15.0, 8 ranks, tensor × pipeline ×
data parallel; tests/producers/data/real/); the broker is real."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from c4base.kafka import KafkaConfig
from producers.columnar import content_type_of, decode_events
from producers.events import ProgressEvent
from producers.exporter import Exporter, ExporterConfig
from producers.exporter.dumps import DumpWatcher, read_snapshot
from producers.formats.fr_wire import SNAPSHOT_HEADER, SnapshotAssembler
from streams.core.pipeline import DetectionPipeline
from streams.detect import run_detect
from tests.kafka_helpers import consume

REAL = Path(__file__).parent / "data" / "real" / "torch-2.15-gloo-3d"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _capture(case: str, moment: str) -> tuple[list[Path], int, int]:
    """The capture's pickle dumps, the wall time (µs) they were written, and the culprit."""
    cap = json.loads((REAL / "captures.json").read_text())[case]
    files = sorted((REAL / case / moment / "pickle").iterdir())
    written = max(cap["file_mtime_ns"][f"{moment}/{f.name}"] for f in files) // 1000
    return files, written, cap["bad_rank"]


def fr_exporter_config(
    d: Path, bootstrap: str, events: str, deadletter: str, job: str, **kw: Any
) -> ExporterConfig:
    """An exporter of Flight Recorder dumps only, one host holding every rank's dump."""
    return ExporterConfig(
        directory=d / "inspector",  # no Inspector logs in these tests
        dump_directory=d / "dumps",
        dump_pattern="comm_lib_trace_rank_*",
        dump_settle_s=1.0,
        dump_gather_s=2.0,
        dump_all_ranks=True,  # one host: every rank's dump lands here
        kafka=KafkaConfig(bootstrap=bootstrap),
        events_topic=events,
        deadletter_topic=deadletter,
        job=job,
        flush_timeout_s=15.0,
        **kw,
    )


def _config(d: Path, bootstrap: str, topics: dict[str, str], **kw: Any) -> ExporterConfig:
    return fr_exporter_config(d, bootstrap, topics["events"], topics["deadletter"], "job-fr", **kw)


def _decode(m) -> list:
    return decode_events(m.value(), content_type_of(m.headers()))


def _worker(msgs: list) -> list:
    """What the stream worker decides: its router (the detect agent's runner) and its
    correlator on the messages as Kafka gave them (headers included), with the
    watermarks the worker sends."""
    from streams.app.correlate_runner import CorrelatorRunner
    from streams.app.deadletter import Record
    from streams.app.detect_runner import CommRouter
    from streams.app.engine import CoreEngine
    from streams.app.watermark import Watermark, encode_watermark
    from streams.verdicts import encode_verdict

    def rec(m) -> Record:
        h = dict(m.headers() or [])
        ct, snap = h.get("content-type"), h.get(SNAPSHOT_HEADER)
        return Record(m.topic(), m.partition(), m.offset(), m.key(), m.value(),
                      content_type=ct, snapshot=snap)  # fmt: skip

    router = CommRouter(CoreEngine(), lambda key: None, checkpoint_every_events=10**9,
                        checkpoint_every_s=1e9, advance_every_us=250_000)  # fmt: skip
    out = router.process([rec(m) for m in msgs])
    assert out.deadletters == [] and router.snapshots.judged == 1
    wall = [0.0]
    corr = CorrelatorRunner(CoreEngine(), lambda key: None, checkpoint_every_events=10**9,
                            checkpoint_every_s=1e9, watermark_topic="wm",
                            clock=lambda: wall[0])  # fmt: skip
    verdicts = [Record("v", 0, i, None, encode_verdict(v), t)
                for i, (v, t) in enumerate(zip(out.verdicts, out.clocks, strict=True))]  # fmt: skip
    cmds = corr.process(verdicts).commands
    # the job is hung: no more events; its partition reports no lag at an unchanged
    # clock, so after idle_s the job's time moves on by wall time and the hang settles
    for _ in range(3):
        marks = [Record("wm", 0, i, None, encode_watermark(
                     Watermark(partition=p, clock_us=t, job=j, caught_up=True)))
                 for i, ((p, j), t) in enumerate(router.clock_us.items())]  # fmt: skip
        cmds += corr.process(marks).commands + corr.tick().commands
        wall[0] += corr.idle_s
    return cmds


def _judge(msgs: list) -> list:
    """What a consumer that knows the ``c4-fr-snapshot`` header decides."""
    asm = SnapshotAssembler()
    cmds = []
    for m in msgs:
        header = dict(m.headers() or []).get(SNAPSHOT_HEADER)
        assert header is not None, "every message of a snapshot carries the header"
        got = asm.add(header, _decode(m))
        if got is not None:
            pipe = DetectionPipeline()
            cmds += pipe.judge_snapshot(*got) + pipe.finish()
    return cmds


@pytest.mark.kafka
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fmt", ["json", "arrow"])
def test_dumps_seen_whole_are_published_with_the_time_seen_and_isolate_the_hang(
    fmt: str, tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 3, "deadletter": 1})
    files, written_us, bad_rank = _capture("dp-hang", "during")
    (tmp_path / "dumps").mkdir()
    clock = Clock()
    wall = [written_us - 5_000_000]
    state = tmp_path / "state.json"
    cfg = _config(tmp_path, kafka_bootstrap, topics, state_file=state, max_batch_events=100,
                  format=fmt)  # fmt: skip
    ex = Exporter(cfg, clock=clock, wall_us=lambda: wall[0])
    ex.poll_once(publish=True)  # the first scan: an empty directory

    # The watchdog writes the dumps in place; rank 0's is seen half written first.
    data0 = files[0].read_bytes()
    (tmp_path / "dumps" / files[0].name).write_bytes(data0[: len(data0) // 2])
    wall[0] = written_us
    ex.poll_once(publish=True)
    for f in files:
        shutil.copyfile(f, tmp_path / "dumps" / f.name)
    clock.t += 0.5
    ex.poll_once(publish=True)  # whole, not settled
    assert ex.stats.events == 0
    clock.t += 1.0
    wall[0] = written_us + 30_000_000  # later polls must not move the time seen
    ex.poll_once(publish=True)  # settled: gathered, not yet published (gather 2 s)
    assert ex.stats.events == 0
    clock.t += 2.0
    ex.poll_once(publish=True)
    assert ex.stats.events > 0 and ex.stats.deadletters == 0
    ex.close()
    assert ex.stats.delivered == ex.stats.messages

    msgs = consume(kafka_bootstrap, topics["events"], expect=ex.stats.messages)
    assert len(msgs) == ex.stats.messages > 1  # split at max_batch_events, one key
    assert len({m.key() for m in msgs}) == 1 and len({m.partition() for m in msgs}) == 1
    events = [e for m in msgs for e in _decode(m)]
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    # every dump's time is the time it was seen whole — 1.5 s before the last poll
    assert {e.ts_us for e in progress} == {written_us}
    cmds = _judge(msgs)
    acting = [(c.host, c.action) for c in cmds if c.action != "alert_only"]
    assert acting == [(f"host-rank{bad_rank}", "cordon_and_taint")], cmds
    # the stream worker judges the snapshot whole, and decides the same
    worker = _worker(msgs)
    assert [(c.host, c.action) for c in worker if c.action != "alert_only"] == acting, worker

    # The same files copied (mtimes lost) only alert.
    copy = tmp_path / "copy"
    shutil.copytree(REAL / "dp-hang" / "during" / "pickle", copy)
    for f in copy.iterdir():
        os.utime(f)
    res = run_detect([copy], tmp_path / "c.jsonl")
    assert [c.action for c in res.commands] == ["alert_only"]
    assert res.commands[0].host == f"host-rank{bad_rank}"

    # A restart publishes nothing again; a rewritten dump (a second dump) is new.
    ex2 = Exporter(cfg, clock=clock, wall_us=lambda: wall[0])
    ex2.poll_once(publish=True)
    clock.t += 5.0
    ex2.poll_once(publish=True)
    assert ex2.stats.events == 0 and ex2.stats.messages == 0
    for f in files:  # the job dumps again (gloo dumps are read together: all of them)
        (tmp_path / "dumps" / f.name).write_bytes(f.read_bytes())
        os.utime(tmp_path / "dumps" / f.name, ns=(written_us * 1000 + 9,) * 2)
    ex2.poll_once(publish=True)
    clock.t += 1.5
    ex2.poll_once(publish=True)
    clock.t += 2.5
    ex2.poll_once(publish=True)
    ex2.close()
    assert ex2.stats.events == ex.stats.events and ex2.stats.deadletters == 0


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_bad_dumps_are_dead_lettered_once_and_nothing_runs(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 1, "deadletter": 1})
    (tmp_path / "dumps").mkdir()
    clock = Clock()
    cfg = _config(tmp_path, kafka_bootstrap, topics, dump_give_up_s=10.0, max_dump_bytes=4096,
                  state_file=tmp_path / "state.json")  # fmt: skip
    ex = Exporter(cfg, clock=clock)
    ex.poll_once(publish=True)
    marker = tmp_path / "ran"
    evil = pickle.dumps({"entries": []})[:2] + (
        b"cposix\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR."
    )
    (tmp_path / "dumps" / "comm_lib_trace_rank_0").write_bytes(evil)
    (tmp_path / "dumps" / "comm_lib_trace_rank_1").write_bytes(b"\x80\x04" + b"x" * 5000)
    (tmp_path / "dumps" / "comm_lib_trace_rank_2").write_bytes(b"\x80\x04}q\x00(X")  # cut
    for _ in range(4):
        clock.t += 4.0
        ex.poll_once(publish=True)
    ex.close()
    assert not marker.exists()
    assert ex.stats.events == 0 and ex.stats.deadletters == 3
    again = Exporter(cfg, clock=clock)  # a restart: each bad version was reported once
    for _ in range(2):
        clock.t += 11.0
        again.poll_once(publish=True)
    again.close()
    assert again.stats.deadletters == 0
    dead = consume(kafka_bootstrap, topics["deadletter"], expect=3)
    reasons = sorted(json.loads(m.value())["reason"] for m in dead)
    assert len(reasons) == 3
    assert "larger than the limit" in reasons[0]
    assert "not a whole dump 10 s after its last change" in reasons[1]  # the cut one
    assert reasons[2].startswith("refused to unpickle posix.system")  # at once


def test_a_nodes_own_directory_does_not_call_other_nodes_ranks_missing(tmp_path: Path) -> None:
    files, written_us, bad = _capture("crash", "during")  # rank 4 died: no dump
    w = DumpWatcher(tmp_path, clock=lambda: 0.0)
    for f in files:
        shutil.copyfile(f, tmp_path / f.name)
    ready, _ = w.poll()
    assert len(ready) == len(files) and all(d.seen_us is None for d in ready)  # there before
    _, _, shared, _ = read_snapshot(ready, job="j", host=None, all_ranks=True)
    assert shared.absent == {bad: "no dump"}
    _, _, node, _ = read_snapshot(ready, job="j", host=None, all_ranks=False)
    assert node.absent == {}
    assert w.poll() == ([], [])  # each version once


@pytest.mark.parametrize(("case", "acting"), [("dp-hang", 1), ("pp-hang", 0), ("healthy", 0)])
def test_ranks_that_share_the_exporters_host_are_told_apart(
    case: str, acting: int, tmp_path: Path
) -> None:
    """A node's exporter names every rank's host after itself (dumps name none), and
    dumps name no GPU: the snapshot judge tells the processes apart by global rank."""
    moment = "end" if case == "healthy" else "during"
    files, written_us, bad = _capture(case, moment)
    w = DumpWatcher(tmp_path, settle_s=0.0, clock=lambda: 0.0, wall_us=lambda: written_us)
    w.poll()  # the first scan: nothing yet
    for f in files:
        shutil.copyfile(f, tmp_path / f.name)
    ready, _ = w.poll()
    assert all(d.seen_us == written_us for d in ready)
    _, read, facts, _ = read_snapshot(ready, job="j", host="node-1", all_ranks=False)
    assert {ev.host for _, ev in read} == {"node-1"}
    pipe = DetectionPipeline()
    cmds = pipe.judge_snapshot([ev for _, ev in read], facts) + pipe.finish()
    isolating = [c for c in cmds if c.action != "alert_only"]
    assert len(isolating) == acting, [(c.action, c.reason) for c in cmds]
    if acting:  # every verdict behind it names the culprit (verdict ranks are group-local)
        assert isolating[0].host == "node-1"
        named = {facts.groups[v.comm].members[v.ranks[0]] for v in pipe.verdicts}
        assert named == {bad}, [v.reason for v in pipe.verdicts]


def test_a_shared_dump_directory_is_not_given_one_host(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without host"):
        ExporterConfig(directory=tmp_path, dump_directory=tmp_path, dump_all_ranks=True,
                       host="node-1")  # fmt: skip
