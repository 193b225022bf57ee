"""The correlator scaled out (issue 22, item 3): verdicts keyed by job on ``c4.verdicts``
with several partitions, shared by two worker instances, decide what one correlator on
one partition decides — per-job rails included (the cap on isolated hosts of a job holds
although its faults are judged by whichever instance owns the job's partition).

Four jobs on one broker, chosen to land on four different verdicts partitions; one of
them has faults on three of its eight hosts, above the default cap of a quarter of the
job's hosts per hour, so its third decision must be alert-only both ways.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Producer

from c4base.kafka import KafkaConfig
from producers.columnar import encode_batch
from producers.events import Event
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.app.settings import WorkerConfig
from streams.app.topics_admin import ensure_topics
from streams.app.watermark import job_partition
from streams.commands import IsolationCommand
from streams.worker import start_worker_process
from tests.streams.test_worker_e2e import offline_commands, read_commands

pytestmark = pytest.mark.kafka

Q = 4


def _jobs() -> list[str]:
    """Four job names on four different partitions of ``Q``."""
    names: dict[int, str] = {}
    i = 0
    while len(names) < Q:
        names.setdefault(job_partition(f"job-{i}", Q), f"job-{i}")
        i += 1
    return [names[q] for q in range(Q)]


JOBS = _jobs()
FAULTS = [
    [  # three hosts of eight: the third decision meets the cap
        FaultSpec(kind="straggler", host=3, gpu=6, start_s=5, end_s=18, severity=2.0),
        FaultSpec(kind="slow_nic", host=5, nic=2, start_s=12, end_s=26, severity=0.4),
        FaultSpec(kind="straggler", host=1, gpu=2, start_s=20, end_s=34, severity=2.0),
    ],
    [FaultSpec(kind="slow_nic", host=2, nic=4, start_s=8, end_s=22, severity=0.4)],
    [FaultSpec(kind="straggler", host=6, gpu=1, start_s=6, end_s=20, severity=1.5)],
    [],  # a healthy job: nothing
]


@pytest.fixture(scope="module")
def traces() -> list[list[list[Event]]]:
    out = []
    for i, (job, faults) in enumerate(zip(JOBS, FAULTS, strict=True)):
        cfg = msgspec.structs.replace(
            SCENARIOS["healthy"], job=job, hosts=8, duration_s=36, seed=11 + i, faults=faults
        )
        out.append([b for b in simulate(cfg) if b])
    return out


def _run(bootstrap: str, tmp: Path, traces: list, n_workers: int, q: int) -> list[IsolationCommand]:
    prefix = f"cs{n_workers}-{uuid.uuid4().hex[:6]}."
    cfgs = [
        WorkerConfig(
            kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=prefix),
            events_partitions=4,
            verdicts_partitions=q,
            workdir=str(tmp / f"w{n_workers}-{i}"),
            checkpoint_every_s=1.0,
            tick_s=0.25,
            session_timeout_s=6.0,
            rebalance_timeout_s=6.0,
            heartbeat_interval_s=0.5,
            loglevel="warning",
        )
        for i in range(n_workers)
    ]
    ensure_topics(cfgs[0])
    topics = cfgs[0].topics()
    # the trace is on the topic before the workers start: they catch up slice by slice
    p = Producer(KafkaConfig(bootstrap=bootstrap).producer_config(**{"linger.ms": 5}))
    total = 0
    for second in zip(*traces, strict=False):  # the jobs interleaved, as they run
        for batch in second:
            value, headers = encode_batch(batch, "arrow")
            p.produce(topics.events, key=batch[0].comm.encode(), value=value, headers=headers)
            total += len(batch)
    assert p.flush(30) == 0
    workers = [start_worker_process(c) for c in cfgs]
    try:
        for w in workers:
            w.wait_ready(90)
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if sum(w.status().get("detect", {}).get("events", 0) for w in workers) >= total:
                break
            time.sleep(0.3)
        time.sleep(4.0)  # the last slices are closed by the tick; verdicts correlated
        cmds = read_commands(bootstrap, topics.isolations, want=99, timeout=10)
        if n_workers > 1:  # both instances correlated some of the jobs
            done = [w.status()["correlate"]["events"] for w in workers]
            assert all(n > 0 for n in done), done
        return cmds
    finally:
        for w in workers:
            w.stop()


def _decisions(cmds: list[IsolationCommand]) -> list[tuple[object, ...]]:
    return sorted((c.id, c.job, c.host, c.gpu, c.nic, c.fault, c.action) for c in cmds)


@pytest.mark.timeout(600)
def test_several_correlators_decide_what_one_decides(
    kafka_bootstrap: str, tmp_path: Path, traces: list
) -> None:
    assert sorted(job_partition(j, Q) for j in JOBS) == list(range(Q))
    offline = [c for t in traces for c in offline_commands(t)]
    capped = [c for c in offline if c.job == JOBS[0]]
    assert [c.action for c in capped].count("alert_only") == 1, _decisions(capped)
    one = _run(kafka_bootstrap, tmp_path, traces, 1, 1)
    many = _run(kafka_bootstrap, tmp_path, traces, 2, Q)
    assert _decisions(many) == _decisions(one) == _decisions(offline)
