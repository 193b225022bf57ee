"""The Faust worker's plumbing against the real broker, with a trivial stand-in detector.

Dead letters (undecodable, contract-breaking, detector failure) while good messages
around them still flow, and a restart that resumes from the table checkpoints. The
stand-in counts events per communicator and flags ops named ``Fault``; run as a script
(``python tests/streams/test_worker_plumbing.py CONFIG.json``) it is the worker process.
"""

from __future__ import annotations

import hashlib
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

if __name__ != "__main__":
    from confluent_kafka import Consumer, Producer, TopicPartition

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from producers.events import OpEvent, encode_message
from streams.app.checkpoint import join_checkpoint
from streams.app.detect_runner import unwrap_state
from streams.app.settings import WorkerConfig
from streams.commands import IsolationCommand, decode_command
from streams.core.columns import EventColumnsLike
from streams.verdicts import Verdict

# ----------------------------------------------------------------------- stand-in engine


class _DetState(msgspec.Struct):
    comm: str
    events: int = 0


class StandInDetector:
    """Counts events; an op named ``Fault`` is a straggler verdict, ``Boom`` raises."""

    def __init__(self, state: _DetState) -> None:
        self.state = state

    def observe(self, cols: EventColumnsLike) -> list[Verdict]:
        events = cols.to_events()
        out = []
        for ev in events:
            if isinstance(ev, OpEvent) and ev.op == "Boom":
                raise ValueError("stand-in detector cannot digest Boom")
        for ev in events:
            self.state.events += 1
            if isinstance(ev, OpEvent) and ev.op == "Fault":
                out.append(
                    Verdict(
                        id=f"v-{ev.comm}-{ev.seq}",
                        ts_us=ev.ts_us,
                        job=ev.job,
                        comm=ev.comm,
                        host=ev.host,
                        fault="straggler",
                        score=1.0,
                        reason="stand-in",
                        window_start_us=ev.ts_us,
                        window_end_us=ev.ts_us,
                        gpu=ev.gpu,
                        evidence={"events_seen": self.state.events},
                    )
                )
        return out

    def advance(self, now_us: int) -> list[Verdict]:
        return []

    def to_bytes(self) -> bytes:
        return msgspec.json.encode(self.state)


class _CorState(msgspec.Struct):
    verdicts: int = 0
    issued: list[str] = []


class StandInCorrelator:
    """One command per (host, gpu, fault), ever: restored state prevents duplicates."""

    def __init__(self, state: _CorState) -> None:
        self.state = state

    def observe(self, v: Verdict) -> list[IsolationCommand]:
        self.state.verdicts += 1
        cid = hashlib.sha1(f"{v.job}|{v.host}|{v.gpu}|{v.fault}".encode()).hexdigest()[:16]
        if cid in self.state.issued:
            return []
        self.state.issued.append(cid)
        return [
            IsolationCommand(
                id=cid,
                ts_us=v.ts_us,
                job=v.job,
                host=v.host,
                fault=v.fault,
                action="alert_only",
                confidence=1.0,
                reason="stand-in",
                gpu=v.gpu,
                evidence={"verdicts": self.state.verdicts},
            )
        ]

    def advance(self, now_us: int, job: str | None = None) -> list[IsolationCommand]:
        return []

    def to_bytes(self) -> bytes:
        return msgspec.json.encode(self.state)


class StandInEngine:
    def new_detector(self, comm: str) -> StandInDetector:
        return StandInDetector(_DetState(comm=comm))

    def load_detector(self, comm: str, data: bytes) -> StandInDetector:
        return StandInDetector(msgspec.json.decode(data, type=_DetState))

    def new_correlator(self) -> StandInCorrelator:
        return StandInCorrelator(_CorState())

    def load_correlator(self, data: bytes) -> StandInCorrelator:
        return StandInCorrelator(msgspec.json.decode(data, type=_CorState))


if __name__ == "__main__":  # the worker process of these tests
    from streams.worker import run_worker

    cfg = msgspec.json.decode(Path(sys.argv[1]).read_bytes(), type=WorkerConfig)
    sys.exit(run_worker(cfg, engine=StandInEngine()))


# ----------------------------------------------------------------------- helpers


def op(
    comm: str,
    seq: int,
    *,
    host: str = "node-000",
    rank: int = 0,
    name: str = "AllReduce",
    nranks: int = 4,
    gpu: int = 0,
) -> OpEvent:
    return OpEvent(
        v=1,
        job="j",
        comm=comm,
        nranks=nranks,
        rank=rank,
        host=host,
        ts_us=1_750_000_000_000_000 + seq * 1000,
        op=name,
        seq=seq,
        bytes=1024,
        exec_us=10.0,
        gpu=gpu,
    )


def worker_config(bootstrap: str, workdir: Path, **kw: object) -> WorkerConfig:
    prefix = f"t{uuid.uuid4().hex[:8]}."
    base = dict(
        kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=prefix),
        events_partitions=2,
        workdir=str(workdir),
        batch_within_s=0.05,
        checkpoint_every_s=0.5,
        tick_s=0.5,
        session_timeout_s=6.0,
        rebalance_timeout_s=6.0,
        heartbeat_interval_s=0.5,
        loglevel="warning",
    )
    base.update(kw)
    return msgspec.convert(base, WorkerConfig, from_attributes=True)


def start_standin(config: WorkerConfig):
    """The worker as a child process running this file (so the stand-in engine is used)."""
    import os
    import subprocess

    from streams.worker import WorkerProcess

    wd = Path(config.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    cfg_path = wd / "worker-config.json"
    cfg_path.write_bytes(msgspec.json.encode(config))
    log_path = wd / "worker.log"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, __file__, str(cfg_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=root,
        )
    return WorkerProcess(proc, config, log_path)


def produce(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for key, value in messages:
        p.produce(topic, key=key, value=value)
    assert p.flush(10) == 0


def read_topic(bootstrap: str, topic: str, *, until, timeout: float) -> list[tuple[bytes, bytes]]:
    """Read ``topic`` from the start until ``until(messages)`` holds or ``timeout`` passes."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"rd-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        md = c.list_topics(topic, timeout=10)
        c.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
        out: list[tuple[bytes, bytes]] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until(out):
            for m in c.consume(500, 0.2):
                if m.error() is None:
                    out.append((m.key(), m.value()))
        return out
    finally:
        c.close()


def dead_letters(msgs: list[tuple[bytes, bytes]]) -> list[DeadLetter]:
    return [DeadLetter.decode(v) for _, v in msgs]


# ----------------------------------------------------------------------- tests


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_malformed_input_is_dead_lettered_and_the_stream_goes_on(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    topics = cfg.topics()
    with start_standin(cfg) as worker:
        worker.wait_ready(60)
        good_before = [op("0xa", s, rank=s % 4) for s in range(8)]
        messages = [
            (b"0xa", encode_message(good_before)),
            (b"0xa", b'{"kind":"op","v":1,'),  # cut off: not JSON
            (b"0xa", encode_message([op("0xa", 9, rank=7)])),  # rank >= nranks
            (b"0xb", encode_message([op("0xb", 1, name="Boom")])),  # the detector raises
            (b"0xa", encode_message([op("0xa", 10, name="Fault", host="node-003", gpu=5)])),
            (b"0xb", encode_message([op("0xb", 2, name="Fault", host="node-001", gpu=2)])),
        ]
        produce(kafka_bootstrap, topics.events, messages)
        produce(kafka_bootstrap, topics.verdicts, [(b"node-009", b'{"v":1,"id":"half a verdict"}')])

        dls = dead_letters(
            read_topic(kafka_bootstrap, topics.deadletter, until=lambda m: len(m) >= 4, timeout=30)
        )
        cmds = read_topic(
            kafka_bootstrap, topics.isolations, until=lambda m: len(m) >= 2, timeout=30
        )
        status = worker.wait_for(lambda s: s["detect"]["events"] >= 10, 10, "done")

    reasons = {dl.reason.split(":")[0]: dl for dl in dls}
    assert set(reasons) == {
        "undecodable message",
        "event breaks the contract",
        "detector error in communicator 0xb",
        "undecodable verdict",
    }, [dl.reason for dl in dls]
    bad_verdict = reasons.pop("undecodable verdict")
    assert bad_verdict.source.startswith(f"{topics.verdicts}[0]@")
    assert bad_verdict.key == "node-009"
    assert "missing required field" in bad_verdict.reason
    dls = list(reasons.values())
    assert reasons["undecodable message"].payload() == b'{"kind":"op","v":1,'
    assert "rank 7 is not below nranks 4" in reasons["event breaks the contract"].reason
    assert "Boom" in reasons["detector error in communicator 0xb"].reason
    for dl in dls:
        assert dl.stage == "worker" and dl.source.startswith(f"{topics.events}[")
        assert dl.source.split("@")[1].isdigit()
    # Good messages before and after the bad ones went all the way to commands.
    got = sorted((decode_command(v).host, decode_command(v).gpu) for _, v in cmds)
    assert got == [("node-001", 2), ("node-003", 5)]
    assert {k for k, _ in cmds} == {b"node-001", b"node-003"}
    assert status["detect"]["events"] == 11  # all decoded events, Boom included
    assert status["detect"]["deadletters"] == 3 and status["detect"]["detector_errors"] == 1


def last_checkpoints(bootstrap: str, changelog: str, until, timeout: float) -> dict[bytes, bytes]:
    """The newest checkpoint per key of a table's changelog topic (chunks joined, the
    router's envelope taken off)."""
    latest: dict[bytes, bytes] = {}

    def done(msgs: list[tuple[bytes, bytes]]) -> bool:
        records = dict(msgs)
        latest.clear()
        for k in records:
            if b"\x00" not in k:  # chunk keys carry a NUL; the manifest is under the key
                data = join_checkpoint(records.get, k)
                latest[k] = unwrap_state(data)[1] if data is not None else b""
        return until(latest)

    read_topic(bootstrap, changelog, until=done, timeout=timeout)
    return latest


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_restart_resumes_from_table_checkpoints(kafka_bootstrap: str, tmp_path: Path) -> None:
    # Checkpoints only every 1000 events or 60 s: what survives the restart was written by
    # the clean stop (SIGTERM), not by a per-event write.
    cfg = worker_config(
        kafka_bootstrap, tmp_path / "w", checkpoint_every_events=1000, checkpoint_every_s=60.0
    )
    topics = cfg.topics()
    comms = ["0xa", "0xb", "0xc"]

    def batch(comm: str, seqs: range, fault_host: str | None = None) -> tuple[bytes, bytes]:
        evs = [op(comm, s, rank=s % 4) for s in seqs]
        if fault_host:
            evs.append(op(comm, seqs.stop, name="Fault", host=fault_host, gpu=1))
        return comm.encode(), encode_message(evs)

    # Run 1: 3 comms x 40 events; one fault on node-007.
    with start_standin(cfg) as w1:
        w1.wait_ready(60)
        produce(
            kafka_bootstrap,
            topics.events,
            [batch(c, range(i, i + 10)) for i in range(0, 40, 10) for c in comms]
            + [batch("0xa", range(40, 41), fault_host="node-007")],
        )
        st1 = w1.wait_for(
            # the fault's verdict reached the correlator (its slice closes once traffic stops)
            lambda s: s["detect"]["events"] >= 122 and s["correlate"]["events"] >= 1,
            30,
            "through run 1",
        )
        assert w1.stop() == 0
    assert st1["detect"]["created"] == 3 and st1["detect"]["restored"] == 0
    ckpt = last_checkpoints(
        kafka_bootstrap, cfg.comm_table_changelog(), lambda d: len(d) >= 3, timeout=20
    )
    counts = {k.decode(): msgspec.json.decode(v)["events"] for k, v in ckpt.items()}
    assert counts == {"0xa": 42, "0xb": 40, "0xc": 40}

    # Run 2: the same fault again (must not give a second command), plus more events.
    with start_standin(cfg) as w2:
        w2.wait_ready(60)
        produce(
            kafka_bootstrap,
            topics.events,
            [batch(c, range(100, 110)) for c in comms]
            + [batch("0xb", range(110, 111), fault_host="node-007")],
        )
        st2 = w2.wait_for(
            lambda s: s["detect"]["events"] >= 32 and s["correlate"]["events"] >= 1,
            30,
            "through run 2",
        )
        assert w2.stop() == 0
    # Restored, not re-created, and not re-fed from the start (offsets were committed).
    assert st2["detect"]["restored"] == 3 and st2["detect"]["created"] == 0
    assert st2["correlate"]["restored"] == 1
    assert st2["detect"]["events"] == 32
    ckpt = last_checkpoints(
        kafka_bootstrap,
        cfg.comm_table_changelog(),
        lambda d: b"0xa" in d and msgspec.json.decode(d[b"0xa"])["events"] > 42,
        timeout=20,
    )
    counts = {k.decode(): msgspec.json.decode(v)["events"] for k, v in ckpt.items()}
    assert counts == {"0xa": 52, "0xb": 52, "0xc": 50}  # counters continued across the restart
    cmds = [
        decode_command(v)
        for _, v in read_topic(kafka_bootstrap, topics.isolations, until=lambda m: False, timeout=2)
    ]
    assert [(c.host, c.gpu) for c in cmds] == [("node-007", 1)]  # no duplicate command
