"""A Flight Recorder snapshot through the exporter, the real broker and a running worker.

The committed torch 2.15 gloo dp-hang capture (8 ranks, rank 5 never enters its
data-parallel all-reduce; dumps 3 s into the hang) is published by the exporter's dump
path (``--fr-dir``: messages of one key with the ``c4-fr-snapshot`` header) into the
events topic of a worker that runs as ``c4stream worker`` does (a child process). Two
jobs, as a user gets them:

* ``job-seen``: the exporter watched the dumps being written, so each dump's time is the
  time it saw it whole — the dump time is known, and the worker cordons rank 5;
* ``job-copied``: the same files copied into the directory before the exporter started
  (mtimes lost): the dump time is unknown, and the worker only alerts about rank 5.

Nothing else is isolated in either job. The broker-free runners' version of this is in
tests/producers/test_exporter_flight_recorder.py.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import msgspec
import pytest

from producers.exporter import Exporter, ExporterConfig
from streams.commands import IsolationCommand
from streams.worker import start_worker_process
from tests.producers.test_exporter_flight_recorder import fr_exporter_config
from tests.streams.test_worker_e2e import read_commands, worker_config

pytestmark = pytest.mark.kafka

REAL = Path(__file__).parents[1] / "producers" / "data" / "real" / "torch-2.15-gloo-3d"


class Clock:
    """The exporter's monotonic clock, moved by the test (settle and gather times)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _exporter(d: Path, bootstrap: str, events: str, job: str) -> ExporterConfig:
    return fr_exporter_config(d, bootstrap, events, events + ".dlq", job,
                              state_file=d / "state.json")  # fmt: skip


def _publish_seen(d: Path, bootstrap: str, events: str, files: list[Path], written_us: int) -> int:
    """The watchdog writes the dumps while the exporter watches: seen whole, then sent."""
    (d / "dumps").mkdir(parents=True)
    clock, wall = Clock(), [written_us - 5_000_000]
    ex = Exporter(_exporter(d, bootstrap, events, "job-seen"), clock=clock, wall_us=lambda: wall[0])
    ex.poll_once(publish=True)  # the first scan: an empty directory
    wall[0] = written_us
    for f in files:
        shutil.copyfile(f, d / "dumps" / f.name)
    ex.poll_once(publish=True)
    for step in (1.5, 2.5):  # settled, then gathered
        clock.t += step
        wall[0] += 30_000_000  # later polls must not move the time seen
        ex.poll_once(publish=True)
    ex.close()
    assert ex.stats.messages > 0 and ex.stats.delivered == ex.stats.messages
    assert ex.stats.deadletters == 0
    return ex.stats.messages


def _publish_copied(d: Path, bootstrap: str, events: str, files: list[Path]) -> int:
    """The same files copied (mtime now, long after the dump), there before the exporter
    starts: it did not see them written, and their mtimes are not trusted."""
    (d / "dumps").mkdir(parents=True)
    for f in files:
        shutil.copyfile(f, d / "dumps" / f.name)
        os.utime(d / "dumps" / f.name)
    clock = Clock()
    ex = Exporter(_exporter(d, bootstrap, events, "job-copied"), clock=clock)
    ex.poll_once(publish=True)
    clock.t += 2.5
    ex.poll_once(publish=True)
    ex.close()
    assert ex.stats.messages > 0 and ex.stats.delivered == ex.stats.messages
    assert ex.stats.deadletters == 0
    return ex.stats.messages


def _by_job(cmds: list[IsolationCommand]) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for c in cmds:
        out.setdefault(c.job, []).append((c.host, c.action))
    return out


@pytest.mark.timeout(150)
def test_the_exporters_snapshot_is_judged_whole_by_a_running_worker(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    cap = json.loads((REAL / "captures.json").read_text())["dp-hang"]
    files = sorted((REAL / "dp-hang" / "during" / "pickle").iterdir())
    written_us = max(cap["file_mtime_ns"][f"during/{f.name}"] for f in files) // 1000
    culprit = f"host-rank{cap['bad_rank']}"
    assert culprit == "host-rank5"

    cfg = msgspec.structs.replace(worker_config(kafka_bootstrap, tmp_path / "w"),
                                  watermark_idle_s=1.0)  # fmt: skip
    topics = cfg.topics()
    with start_worker_process(cfg) as worker:
        worker.wait_ready(60)
        sent = _publish_seen(tmp_path / "seen", kafka_bootstrap, topics.events, files, written_us)
        sent += _publish_copied(tmp_path / "copied", kafka_bootstrap, topics.events, files)
        # the job is hung: no more events; the correlator settles each job's hang once
        # its partition is idle (watermarks), as a real hang's would
        cmds = read_commands(kafka_bootstrap, topics.isolations, want=2, timeout=45)
        time.sleep(3.0)  # anything else the worker decides arrives too (there is nothing)
        cmds = read_commands(kafka_bootstrap, topics.isolations, want=99, timeout=3)
        stats = worker.status()
    assert sent >= 2  # one snapshot per job, each of one message or more
    got = _by_job(cmds)
    assert got.get("job-seen") == [(culprit, "cordon_and_taint")], (got, stats)
    assert got.get("job-copied") == [(culprit, "alert_only")], (got, stats)
    copied = next(c for c in cmds if c.job == "job-copied")
    assert "dump time unknown" in copied.reason or "not isolated" in copied.reason, copied.reason
