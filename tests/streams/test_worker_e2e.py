"""End to end through the real broker and the real detection core.

A simulated job (4 hosts x 8 GPUs) whose GPU 1 on node-002 hangs at 15 s is replayed
into ``c4.events``; the worker (a child process, as ``c4stream worker`` runs it) must
put the isolation command for exactly that GPU on ``c4.isolations``, in event time
within 10 s of the hang, and agree with the broker-free DetectionPipeline.
A second run stops the worker half-way through the trace and starts it again: the
detectors come back from their table checkpoints and the fault is still found once.
"""

from __future__ import annotations

import os
import pickle
import time
import uuid
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.kafka_admin import create_topics
from producers.events import Event, encode_message
from producers.simulator import SCENARIOS, FaultSpec, ground_truth, simulate
from streams.app.settings import WorkerConfig
from streams.commands import IsolationCommand, decode_command
from streams.core import DetectionPipeline
from streams.worker import start_worker_process

pytestmark = pytest.mark.kafka

HANG_AT_S = 15
SIM = msgspec.structs.replace(
    SCENARIOS["rank_hang"],
    hosts=4,
    duration_s=25,
    faults=[FaultSpec(kind="rank_hang", host=2, gpu=1, start_s=HANG_AT_S)],
)


@pytest.fixture(scope="module")
def trace() -> list[list[Event]]:
    return [b for b in simulate(SIM) if b]


def worker_config(bootstrap: str, workdir: Path) -> WorkerConfig:
    return WorkerConfig(
        kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=f"e{uuid.uuid4().hex[:8]}."),
        events_partitions=4,
        workdir=str(workdir),
        batch_within_s=0.05,
        checkpoint_every_s=1.0,
        tick_s=0.5,
        session_timeout_s=6.0,
        rebalance_timeout_s=6.0,
        heartbeat_interval_s=0.5,
        loglevel="warning",
    )


def replay(bootstrap: str, topic: str, batches: list[list[Event]]) -> None:
    """Each batch (one host, one communicator, one second) as one message keyed by comm,
    with the exporters' producer settings (zstd: aiokafka needs cramjam to read it)."""
    p = Producer(KafkaConfig(bootstrap=bootstrap).producer_config(**{"linger.ms": 5}))
    for batch in batches:
        p.produce(topic, key=batch[0].comm.encode(), value=encode_message(batch))
    assert p.flush(10) == 0


def read_commands(
    bootstrap: str, topic: str, *, want: int, timeout: float
) -> list[IsolationCommand]:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"rd-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    c.assign([TopicPartition(topic, 0, 0)])
    out: list[IsolationCommand] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(out) < want:
            for m in c.consume(100, 0.2):
                if m.error() is None:
                    out.append(decode_command(m.value()))
        return out
    finally:
        c.close()


def offline_commands(trace: list[list[Event]]) -> list[IsolationCommand]:
    p = DetectionPipeline()
    for batch in trace:
        p.feed(batch)
    p.finish()
    return p.commands


@pytest.mark.timeout(90)
def test_replayed_hang_comes_out_as_the_right_isolation_command(
    kafka_bootstrap: str, tmp_path: Path, trace: list[list[Event]]
) -> None:
    truth = ground_truth(SIM).faults[0]
    assert (truth.host, truth.gpu, truth.expected_fault) == ("node-002", 1, "noncomm_hang")
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    t0 = time.monotonic()
    with start_worker_process(cfg) as worker:
        worker.wait_ready(60)
        replay(kafka_bootstrap, cfg.topics().events, trace)
        cmds = read_commands(kafka_bootstrap, cfg.topics().isolations, want=1, timeout=30)
        elapsed = time.monotonic() - t0
        # Let anything else the worker might decide arrive too (there should be nothing).
        worker.wait_for(lambda s: s["detect"]["events"] == sum(map(len, trace)), 20, "through")
        time.sleep(1.5)
        cmds = read_commands(kafka_bootstrap, cfg.topics().isolations, want=99, timeout=2)
        status = worker.status()
    assert cmds, f"no isolation command after {elapsed:.1f}s; worker log:\n{worker.log_tail()}"
    assert [(c.host, c.gpu, c.fault) for c in cmds] == [("node-002", 1, "noncomm_hang")]
    cmd = cmds[0]
    assert 0 <= cmd.ts_us - truth.start_us <= 10_000_000, "hang isolated within 10 s event time"
    assert cmd.job == SIM.job and cmd.reason and cmd.evidence
    assert status["detect"]["deadletters"] == 0 and status["detect"]["detector_errors"] == 0
    # The Faust path and the broker-free path decide the same.
    offline = offline_commands(trace)
    assert [(c.host, c.gpu, c.fault) for c in offline] == [("node-002", 1, "noncomm_hang")]
    assert cmd.id == offline[0].id


@pytest.mark.timeout(120)
def test_worker_stopped_mid_trace_resumes_from_its_checkpoints(
    kafka_bootstrap: str, tmp_path: Path, trace: list[list[Event]]
) -> None:
    split_us = ground_truth(SIM).faults[0].start_us - 4_000_000  # 11 s in, before the hang
    first = [b for b in trace if b[0].ts_us < split_us]
    rest = [b for b in trace if b[0].ts_us >= split_us]
    n_first = sum(map(len, first))
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    topics = cfg.topics()

    with start_worker_process(cfg) as w1:
        w1.wait_ready(60)
        replay(kafka_bootstrap, topics.events, first)
        st1 = w1.wait_for(lambda s: s["detect"]["events"] >= n_first, 30, "through part 1")
        assert w1.stop() == 0
    comms = st1["comms"]
    assert comms > 0 and st1["detect"]["restored"] == 0

    with start_worker_process(cfg) as w2:
        w2.wait_ready(60)
        replay(kafka_bootstrap, topics.events, rest)
        cmds = read_commands(kafka_bootstrap, topics.isolations, want=1, timeout=30)
        st2 = w2.wait_for(lambda s: s["detect"]["events"] >= sum(map(len, rest)), 20, "through")
        time.sleep(1.5)
        cmds = read_commands(kafka_bootstrap, topics.isolations, want=99, timeout=2)
    # Every communicator came back from the table; nothing was re-read from the start.
    assert st2["detect"]["restored"] == comms and st2["detect"]["created"] == 0
    assert st2["detect"]["events"] == sum(map(len, rest))
    assert [(c.host, c.gpu, c.fault) for c in cmds] == [("node-002", 1, "noncomm_hang")]
    assert cmds[0].id == offline_commands(trace)[0].id  # same decision as without a restart


@pytest.mark.timeout(120)
def test_second_worker_takes_over_partitions_with_their_state(
    kafka_bootstrap: str, tmp_path: Path, trace: list[list[Event]]
) -> None:
    split_us = ground_truth(SIM).faults[0].start_us - 4_000_000
    first = [b for b in trace if b[0].ts_us < split_us]
    rest = [b for b in trace if b[0].ts_us >= split_us]
    cfg_a = worker_config(kafka_bootstrap, tmp_path / "a")
    cfg_b = msgspec.structs.replace(cfg_a, workdir=str(tmp_path / "b"))  # same group
    topics = cfg_a.topics()

    with start_worker_process(cfg_a) as wa:
        wa.wait_ready(60)
        replay(kafka_bootstrap, topics.events, first)
        st_a = wa.wait_for(
            lambda s: s["detect"]["events"] >= sum(map(len, first)), 30, "through part 1"
        )
        with start_worker_process(cfg_b) as wb:
            # The rebalance: A checkpoints and drops what it gives up, B restores it.
            st_b = wb.wait_for(
                lambda s: s.get("ready") and any("c4.events" in a for a in s["assigned"]),
                60,
                "assigned events partitions",
            )
            st_a = wa.wait_for(
                lambda s: len(s["assigned"]) < 5 and s["comms"] < st_a["comms"], 30, "rebalanced"
            )
            replay(kafka_bootstrap, topics.events, rest)
            # The correlator holds verdicts until every events partition has passed them;
            # under load Faust's table recovery after the rebalance can stall one owner
            # for ~30 s, and the command rightly waits for it.
            cmds = read_commands(kafka_bootstrap, topics.isolations, want=1, timeout=60)
            st_b = wb.wait_for(lambda s: s["detect"]["restored"] > 0, 20, "restored state")
            time.sleep(1.5)
            cmds = read_commands(kafka_bootstrap, topics.isolations, want=99, timeout=2)
    assert st_b["detect"]["created"] == 0  # every communicator B serves came from the table
    assert [(c.host, c.gpu, c.fault) for c in cmds] == [("node-002", 1, "noncomm_hang")]


class _Evil:
    """Unpickling this would run a shell command (what a writer of the changelog could do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.path}",))


def read_dead_letters(bootstrap: str, topic: str, *, until, timeout: float) -> list[DeadLetter]:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"rd-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
        }
    )
    c.assign([TopicPartition(topic, 0, 0)])
    out: list[DeadLetter] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not until(out):
            for m in c.consume(100, 0.2):
                if m.error() is None:
                    out.append(DeadLetter.decode(m.value()))
        return out
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_a_forged_checkpoint_is_dead_lettered_and_never_run(
    kafka_bootstrap: str, tmp_path: Path, trace: list[list[Event]]
) -> None:
    """A pickle that would run code sits in the communicator table's changelog (every
    partition) before the worker starts: the worker refuses it with a dead letter, that
    communicator starts afresh, and the hang is still isolated."""
    marker = tmp_path / "pwned"
    forged = pickle.dumps({"state": _Evil(marker)}, protocol=5)
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    topics = cfg.topics()
    comm = next(b[0].comm for b in trace if b[0].host == "node-002")
    create_topics(kafka_bootstrap, cfg.all_topics())
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for part in range(cfg.events_partitions):
        p.produce(cfg.comm_table_changelog(), key=comm.encode(), value=forged, partition=part)
    assert p.flush(10) == 0

    with start_worker_process(cfg) as worker:
        worker.wait_ready(60)
        replay(kafka_bootstrap, topics.events, trace)
        cmds = read_commands(kafka_bootstrap, topics.isolations, want=1, timeout=30)
        dls = read_dead_letters(
            kafka_bootstrap, topics.deadletter, until=lambda d: len(d) >= 1, timeout=20
        )
        status = worker.status()
    assert [(d.source, d.payload()) for d in dls] == [(f"checkpoint:{comm}", forged)]
    assert dls[0].reason.startswith("checkpoint refused, state starts afresh: not a c4stream")
    assert not marker.exists()
    assert status["detect"]["restored"] == 0
    assert [(c.host, c.gpu, c.fault) for c in cmds] == [("node-002", 1, "noncomm_hang")]
