"""Windows at the source through the real broker and a real worker (issue 22, item 2).

One high-rate fault trace (a straggler, then a slow NIC, then a rank hang; ~90
collectives per second per rank) is summarised as exporters with ``summary_k = 16`` send
it (progress unchanged, samples and one summary per rank and window) and put on
``c4.events`` as JSON and, separately, as Arrow. The worker must isolate the same
components for the same faults with the same actions as the detection core decides on
the raw trace (every collective) — the hang, on a third host of eight, alert-only by
the cap on a quarter of a job's hosts per hour — at most one window later, from about a tenth of the
records; a summary that breaks its contract is dead-lettered with the reason, and
nothing else is lost.

The raw trace itself is judged offline (the core ``c4stream detect`` runs), which is
the reference and keeps this test short; a worker catching up on the raw backlog (~140k
events, judged faster than real time) once dead-lettered verdicts as "late by 13–17 s"
at the correlator: its watermark counted marks after a wall time whether or not their
verdicts had been read (``tests/streams/test_correlator_backlog.py`` reproduces it
broker-free; fixed), and later because the timer's watermarks overtook verdicts agent
``detect`` was still sending (``tests/streams/test_watermark_routing.py``; fixed).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Producer

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from producers.events import encode_message
from producers.simulator import FaultSpec, SimConfig, simulate
from producers.summary import SummaryEvent, encode_summary_message, expand, summarised
from producers.summary_arrow import encode_arrow_with_summaries
from streams.app.settings import WorkerConfig
from streams.app.topics_admin import ensure_topics
from streams.commands import IsolationCommand
from streams.worker import start_worker_process
from tests.kafka_helpers import consume
from tests.streams.test_worker_e2e import offline_commands, read_commands

pytestmark = pytest.mark.kafka

K = 16
SIM = SimConfig(
    job="sumk",
    hosts=8,
    gpus_per_host=4,
    tp=4,
    duration_s=48,
    iteration_s=0.04,  # with 4 DP buckets: ~90 collectives per second per rank
    dp_buckets=4,
    tp_bytes=1 << 20,
    dp_bytes=4 << 20,
    seed=5,
    faults=[
        FaultSpec(kind="straggler", host=3, gpu=2, start_s=6, end_s=20, severity=1.5),
        FaultSpec(kind="slow_nic", host=5, nic=1, start_s=20, end_s=33, severity=0.4),
        FaultSpec(kind="rank_hang", host=6, gpu=1, start_s=36),
    ],
)


def _messages(form: str) -> tuple[list[tuple[bytes, bytes, list]], int]:
    """(key, value, headers) per message and the events the worker should count."""
    out: list[tuple[bytes, bytes, list]] = []
    events = 0
    if form == "raw":
        for batch in simulate(SIM):
            out.append((batch[0].comm.encode(), encode_message(batch), []))
            events += len(batch)
        return out, events
    for recs in summarised(simulate(SIM), K):
        events += len(expand(recs))
        if form == "json":
            out.append((recs[0].comm.encode(), encode_summary_message(recs), []))
        else:
            value, headers = encode_arrow_with_summaries(recs)
            out.append((recs[0].comm.encode(), value, headers))
    return out, events


def _bad_summary() -> bytes:
    s = next(
        r for recs in summarised(simulate(SIM), K) for r in recs if isinstance(r, SummaryEvent)
    )
    doc = msgspec.json.decode(msgspec.json.encode(s))
    doc["sv"] = 2  # a summary version this worker does not know
    return msgspec.json.encode([doc])


def _run(bootstrap: str, tmp: Path, form: str) -> tuple[list[IsolationCommand], int, list]:
    cfg = WorkerConfig(
        kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=f"sm{form}-{uuid.uuid4().hex[:6]}."),
        events_partitions=4,
        workdir=str(tmp / form),
        checkpoint_every_s=1.0,
        tick_s=0.25,
        session_timeout_s=6.0,
        rebalance_timeout_s=6.0,
        heartbeat_interval_s=0.5,
        loglevel="warning",
    )
    ensure_topics(cfg)
    topics = cfg.topics()
    msgs, total = _messages(form)
    p = Producer(KafkaConfig(bootstrap=bootstrap).producer_config(**{"linger.ms": 5}))
    for key, value, headers in msgs:
        p.produce(topics.events, key=key, value=value, headers=headers or None)
    if form == "json":
        p.produce(topics.events, key=b"bad", value=_bad_summary())
    assert p.flush(30) == 0
    w = start_worker_process(cfg)
    try:
        w.wait_ready(90)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if w.status().get("detect", {}).get("events", 0) >= total:
                break
            time.sleep(0.2)
        assert w.status()["detect"]["events"] == total, w.status()["detect"]
        read_commands(bootstrap, topics.isolations, want=3, timeout=60)
        time.sleep(2.0)
        cmds = read_commands(bootstrap, topics.isolations, want=99, timeout=3)
        dead = consume(bootstrap, topics.deadletter, expect=1 if form == "json" else 0, timeout=10)
        return cmds, len(msgs), dead
    finally:
        w.stop()


def _reason(msg: object) -> str:
    return msgspec.json.decode(msg.value(), type=DeadLetter).reason  # type: ignore[attr-defined]


def _decisions(cmds: list[IsolationCommand]) -> list[tuple[object, ...]]:
    return sorted((c.host, c.gpu, c.nic, c.fault, c.action, c.dry_run) for c in cmds)


@pytest.mark.timeout(600)
def test_summarised_input_gives_the_worker_the_same_decisions_as_raw(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    # raw: what the detection core decides on every collective (``c4stream detect``'s
    # pipeline, see the module doc)
    raw = offline_commands([b for b in simulate(SIM) if b])
    faults = {c.fault for c in raw}
    assert {"straggler", "slow_nic", "noncomm_hang"} <= faults, _decisions(raw)
    first = {(c.host, c.fault): c.ts_us for c in raw}
    for form in ("json", "arrow"):
        got, _, dead = _run(kafka_bootstrap, tmp_path, form)
        assert _decisions(got) == _decisions(raw), form
        # the same decisions at most one detection window (5 s) later
        for c in got:
            assert c.ts_us - first[(c.host, c.fault)] <= 5_000_000 + 1_000_000, (form, c)
        if form == "json":
            assert len(dead) == 1, [_reason(d) for d in dead]
            reason = _reason(dead[0])
            assert "Invalid enum value 2 - at `$[0].sv`" in reason, reason
        else:
            assert dead == [], [_reason(d) for d in dead]
