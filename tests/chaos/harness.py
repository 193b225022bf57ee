"""What the chaos scenarios share: a faulty trace, a worker, readers of what came out,
and the summary table (printed at the end of the session by tests/chaos/conftest.py).

Counting rules of the table:

* sent: messages the scenario wrote (good + bad);
* dead-lettered: dead letters the worker wrote for them (each must name its reason);
* lost: good events the worker did not judge (fuzz: sent - judged from ``status.json``;
  restarts: messages of ``c4.events`` never committed as processed by the worker's group);
* duplicated: isolating commands beyond the first for one fault identity (job, host,
  GPU/NIC/peer, fault), i.e. what an id-only actuator would act on twice; ``acted``
  counts what the actuator's ledger (fault identity + id) let through;
* faults found / false isolations: isolating commands for the injected fault / for
  anything else.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from confluent_kafka import Consumer, Producer, TopicPartition

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from producers.events import Event, encode_message
from producers.simulator import SCENARIOS, FaultSpec, simulate
from sinks.actuator.backends import ActionOutcome
from sinks.actuator.config import ActuatorConfig
from sinks.actuator.consumer import Actuator
from sinks.actuator.ledger import Ledger
from streams.app.settings import WorkerConfig
from streams.commands import IsolationCommand, decode_command

HANG_AT_S = 15
SIM = msgspec.structs.replace(
    SCENARIOS["rank_hang"],
    hosts=4,
    duration_s=25,
    faults=[FaultSpec(kind="rank_hang", host=2, gpu=1, start_s=HANG_AT_S)],
)
TRUTH = ("node-002", 1, "noncomm_hang")


def trace() -> list[list[Event]]:
    return [b for b in simulate(SIM) if b]


@dataclass
class Row:
    scenario: str
    sent: int = 0
    deadlettered: int = 0
    lost: int = 0
    duplicated: int = 0
    acted: int | None = None
    found: str = ""
    false_isolations: int = 0
    notes: str = ""


ROWS: list[Row] = []


def table() -> str:
    head = (
        "| scenario | sent | dead-lettered | lost | duplicated | acted | faults found "
        "| false isolations | notes |\n|---|---:|---:|---:|---:|---:|---|---:|---|\n"
    )
    return head + "".join(
        f"| {r.scenario} | {r.sent} | {r.deadlettered} | {r.lost} | {r.duplicated} | "
        f"{'' if r.acted is None else r.acted} | {r.found} | {r.false_isolations} | {r.notes} |\n"
        for r in ROWS
    )


def worker_config(bootstrap: str, workdir: Path, **kw: object) -> WorkerConfig:
    base: dict = dict(
        kafka=KafkaConfig(bootstrap=bootstrap, topic_prefix=f"x{uuid.uuid4().hex[:8]}."),
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
    base.update(kw)
    return WorkerConfig(**base)


Headers = list[tuple[str, bytes]]


def produce(
    bootstrap: str,
    topic: str,
    msgs: Sequence[tuple[bytes | None, bytes] | tuple[bytes | None, bytes, Headers | None]],
) -> None:
    """Write ``(key, value)`` or ``(key, value, headers)`` messages, in order."""
    p = Producer(
        KafkaConfig(bootstrap=bootstrap).producer_config(
            **{"linger.ms": 5, "message.max.bytes": 4 * 1024 * 1024}
        )
    )
    for key, value, *headers in msgs:
        p.produce(topic, key=key, value=value, headers=headers[0] if headers else None)
        p.poll(0)
    assert p.flush(30) == 0


def as_messages(batches: list[list[Event]]) -> list[tuple[bytes | None, bytes]]:
    return [(b[0].comm.encode(), encode_message(b)) for b in batches]


def read(bootstrap: str, topic: str, *, until=None, timeout: float = 5.0) -> list[bytes]:
    """Every value of ``topic`` (all partitions) until ``until(values)`` or timeout."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"rd-{uuid.uuid4().hex}"})
    try:
        md = c.list_topics(topic, timeout=10)
        parts = md.topics[topic].partitions if topic in md.topics else {}
        c.assign([TopicPartition(topic, p, 0) for p in parts])
        out: list[bytes] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (until and until(out)):
            out += [m.value() for m in c.consume(500, 0.2) if m.error() is None]
        return out
    finally:
        c.close()


def commands(bootstrap: str, topic: str, *, want: int = 10**9, timeout: float = 3.0):
    raw = read(bootstrap, topic, until=lambda v: len(v) >= want, timeout=timeout)
    return [decode_command(v) for v in raw]


def deadletters(bootstrap: str, topic: str, *, want: int = 10**9, timeout: float = 3.0):
    raw = read(bootstrap, topic, until=lambda v: len(v) >= want, timeout=timeout)
    return [DeadLetter.decode(v) for v in raw]


@dataclass
class Verdict:
    found: bool
    false_isolations: int
    duplicated: int
    isolating: list[IsolationCommand] = field(default_factory=list)


def judge(cmds: list[IsolationCommand]) -> Verdict:
    """Isolating commands (not alert_only) against the injected fault."""
    iso = [c for c in cmds if c.action != "alert_only"]
    keys = [(c.job, c.host, c.gpu, c.nic, c.peer_host, c.fault) for c in iso]
    found = any((c.host, c.gpu, c.fault) == TRUTH for c in iso)
    false = sum(1 for c in iso if (c.host, c.gpu, c.fault) != TRUTH)
    return Verdict(found, false, len(keys) - len(set(keys)), iso)


class Recording:
    """An actuator backend that records what it would cordon (the real backends have
    their own tests; here only the actuator's rules and the ledger matter)."""

    name = "recording"

    def __init__(self) -> None:
        self.applied: list[str] = []

    def describe(self, cmd: IsolationCommand) -> str:
        return f"cordon {cmd.host}"

    def apply(self, cmd: IsolationCommand) -> ActionOutcome:
        self.applied.append(cmd.host)
        return ActionOutcome(changed=True, detail=f"cordoned {cmd.host}")


def acted(cmds: list[IsolationCommand], ledger: Path) -> list[str]:
    """Hosts an executing actuator acts on, fed ``cmds`` in order (policy dry_run off)."""
    backend = Recording()
    with Ledger(ledger) as led:
        act = Actuator(ActuatorConfig(execute=True), backend, led)
        for c in cmds:
            act.handle(msgspec.structs.replace(c, dry_run=False))
    return backend.applied


def read_records(bootstrap: str, topic: str, timeout: float = 10.0) -> dict[bytes, bytes | None]:
    """The newest value per key of ``topic`` (a changelog), read until 1 s of quiet."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"rd-{uuid.uuid4().hex}"})
    out: dict[bytes, bytes | None] = {}
    try:
        md = c.list_topics(topic, timeout=10)
        c.assign([TopicPartition(topic, p, 0) for p in md.topics[topic].partitions])
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline and quiet < 5:
            batch = [m for m in c.consume(1000, 0.2) if m.error() is None]
            quiet = quiet + 1 if not batch and out else 0
            out.update((m.key(), m.value()) for m in batch)
        return out
    finally:
        c.close()


def offsets(bootstrap: str, group: str, topic: str) -> dict[int, tuple[int | None, int, int]]:
    """Per partition of ``topic``: ``group``'s committed offset (None: none), low, high."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        md = c.list_topics(topic, timeout=10)
        tps = [TopicPartition(topic, p) for p in md.topics[topic].partitions]
        out = {}
        for tp in c.committed(tps, timeout=10):
            low, high = c.get_watermark_offsets(tp, timeout=10)
            out[tp.partition] = (tp.offset if tp.offset >= 0 else None, low, high)
        return dict(sorted(out.items()))
    finally:
        c.close()


def unconsumed(bootstrap: str, group: str, topic: str) -> int:
    """Messages of ``topic`` that ``group`` has not committed as processed (Faust commits
    after processing): with the worker stopped, what it would never have judged."""
    return sum(
        max(0, high - (low if done is None else done))
        for done, low, high in offsets(bootstrap, group, topic).values()
    )


def offsets_report(bootstrap: str, group: str, topics: list[str]) -> str:
    """``topic[p]: committed/low/high`` lines, for a failed ``lost == 0``."""
    return "\n".join(
        f"{t}[{p}]: committed {done}, low {low}, high {high}"
        for t in topics
        for p, (done, low, high) in offsets(bootstrap, group, t).items()
    )
