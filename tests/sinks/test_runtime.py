"""The shared consumer runner (c4base.runtime) on the real broker, with a small handler.

Classified failures: transient (retried with back-off, nothing committed past it, then
handled), transient past the retry window (dead-lettered with the reason), permanent
(dead-lettered at once, the rest goes on), fatal (the runner stops, raises, commits
nothing more). Plus holds: an offset is committed only once its hold is released.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.metrics import NullMetrics
from c4base.runtime import (
    BaseHandler,
    BatchFailed,
    ConsumerRunner,
    Context,
    FatalError,
    Hold,
    PermanentError,
    Record,
    Rewind,
    RunnerConfig,
    TransientError,
)
from compose.local_broker import create_topics

pytestmark = pytest.mark.kafka


class Script(BaseHandler):
    """Handles b"ok", fails per value: b"transient:N" fails N times, b"permanent",
    b"fatal", b"hold" takes a hold the test releases."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.failures: dict[bytes, int] = {}
        self.holds: list[Hold] = []

    def handle(self, rec: Record, ctx: Context) -> None:
        self.seen.append(rec.value)
        v = rec.value
        if v.startswith(b"transient:"):
            n = int(v.split(b":")[1])
            done = self.failures.get(v, 0)
            if done < n:
                self.failures[v] = done + 1
                raise TransientError(f"try {done + 1} of {v.decode()}")
        elif v == b"permanent":
            raise PermanentError("refused for good")
        elif v == b"fatal":
            raise FatalError("configuration is wrong")
        elif v == b"hold":
            self.holds.append(ctx.hold(rec))


def _topics(bootstrap: str) -> tuple[str, str]:
    t, dl = f"rt-{uuid.uuid4().hex[:8]}", f"rt-dl-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, {t: 1, dl: 1}, 30.0)
    return t, dl


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for v in values:
        p.produce(topic, v)
    assert p.flush(10) == 0


def _committed(bootstrap: str, group: str, topic: str) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    (tp,) = c.committed([TopicPartition(topic, 0)], timeout=10)
    c.close()
    return tp.offset


def _letters(bootstrap: str, topic: str, n: int) -> list[DeadLetter]:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
        }
    )
    c.subscribe([topic])
    out: list[DeadLetter] = []
    deadline = time.monotonic() + 10
    while len(out) < n and time.monotonic() < deadline:
        out += [DeadLetter.decode(m.value()) for m in c.consume(10, 0.5) if m.error() is None]
    c.close()
    return out


def _runner(bootstrap: str, topic: str, dl: str, handler: BaseHandler, **kw: object):
    cfg = RunnerConfig(
        stage="test",
        topics=[topic],
        deadletter_topic=dl,
        group=f"g-{uuid.uuid4().hex[:6]}",
        kafka=KafkaConfig(bootstrap=bootstrap),
        instance_id="",
        retry_base_s=0.05,
        retry_max_s=0.2,
        **kw,  # type: ignore[arg-type]
    )
    return ConsumerRunner(cfg, handler, metrics=NullMetrics())


def _until(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_transient_is_retried_permanent_and_expired_are_dead_lettered(
    kafka_bootstrap: str,
) -> None:
    topic, dl = _topics(kafka_bootstrap)
    values = [b"ok", b"transient:3", b"ok", b"permanent", b"transient:1000", b"ok"]
    _produce(kafka_bootstrap, topic, values)
    h = Script()
    r = _runner(kafka_bootstrap, topic, dl, h, retry_for_s=1.0, exit_when_idle_s=1.0)
    stats = r.run()
    # transient:3 was tried 4 times and then handled, in order: nothing overtook it.
    assert h.seen[:5] == [b"ok"] + [b"transient:3"] * 4
    assert h.seen.index(b"permanent") > h.seen.index(b"transient:3") + 3
    assert stats.handled == len(values) and stats.deadlettered == 2
    letters = _letters(kafka_bootstrap, dl, 2)
    by_payload = {d.payload(): d for d in letters}
    assert by_payload[b"permanent"].reason == "refused for good"
    assert by_payload[b"permanent"].source == f"{topic}[0]@3"
    assert by_payload[b"transient:1000"].reason.startswith("gave up after ")
    assert "TransientError: try" in by_payload[b"transient:1000"].reason
    assert _committed(kafka_bootstrap, r.cfg.group, topic) == len(values)


@pytest.mark.timeout(60)
def test_fatal_stops_without_committing_past_it(kafka_bootstrap: str) -> None:
    topic, dl = _topics(kafka_bootstrap)
    _produce(kafka_bootstrap, topic, [b"ok", b"ok", b"fatal", b"ok"])
    h = Script()
    r = _runner(kafka_bootstrap, topic, dl, h)
    with pytest.raises(FatalError, match="configuration is wrong"):
        r.run()
    assert h.seen == [b"ok", b"ok", b"fatal"]
    assert _committed(kafka_bootstrap, r.cfg.group, topic) <= 2  # never past the fatal one
    assert r.status()["state"] == "failed" and r.status()["ready"] is False


@pytest.mark.timeout(60)
def test_a_hold_keeps_the_commit_below_it_until_released(kafka_bootstrap: str) -> None:
    topic, dl = _topics(kafka_bootstrap)
    _produce(kafka_bootstrap, topic, [b"ok", b"hold", b"ok", b"ok"])
    h = Script()
    r = _runner(kafka_bootstrap, topic, dl, h)
    t = threading.Thread(target=r.run)
    t.start()
    try:
        _until(lambda: r.stats.handled == 4)
        time.sleep(1.0)
        assert _committed(kafka_bootstrap, r.cfg.group, topic) == 1  # stops at the hold
        assert r.status()["held"] == 1 and r.status()["ready"] is True
        h.holds[0].release()
        _until(lambda: _committed(kafka_bootstrap, r.cfg.group, topic) == 4)
    finally:
        r.stop.set()
        t.join(20)
    assert not t.is_alive()


@pytest.mark.timeout(60)
def test_idle_exit_is_not_reset_by_broker_probes(kafka_bootstrap: str) -> None:
    """The broker is probed every second while idle; being idle 3 s still ends the run."""
    topic, dl = _topics(kafka_bootstrap)
    _produce(kafka_bootstrap, topic, [b"ok"])
    r = _runner(kafka_bootstrap, topic, dl, Script(), probe_s=1.0, exit_when_idle_s=3.0)
    t0 = time.monotonic()
    stats = r.run()
    assert stats.handled == 1
    assert time.monotonic() - t0 < 20


class Buffering(BaseHandler):
    """Records are durable only at a b"flush"; the first b"lose" loses the buffer (a
    full disk taking an open file) and asks to read again from its lowest offset."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.buffer: dict[tuple[str, int], int] = {}
        self.lost = False

    def handle_batch(self, records, ctx):  # type: ignore[no-untyped-def]
        for i, rec in enumerate(records):
            self.seen.append(rec.offset)
            if rec.value == b"lose" and not self.lost:
                self.lost = True
                floor, self.buffer = dict(self.buffer), {}
                raise BatchFailed(i, Rewind("buffer lost", floor, retry_after_s=0.3))
            if rec.value == b"flush":
                self.buffer.clear()
            else:
                self.buffer.setdefault(rec.tp, rec.offset)

    def pending(self) -> dict[tuple[str, int], int]:
        return dict(self.buffer)

    def close(self, stop_by: float, ctx: Context) -> None:
        self.buffer.clear()  # made durable at a clean stop


@pytest.mark.timeout(60)
def test_rewind_reads_the_lost_records_again_and_commits_nothing_past_them(
    kafka_bootstrap: str,
) -> None:
    topic, dl = _topics(kafka_bootstrap)
    values = [b"ok", b"ok", b"flush", b"ok", b"ok", b"lose", b"ok"]
    _produce(kafka_bootstrap, topic, values)
    h = Buffering()
    r = _runner(kafka_bootstrap, topic, dl, h, exit_when_idle_s=1.0)
    stats = r.run()
    # 0..5, then again from 3 (the lost buffer's lowest offset) to the end
    assert h.seen == [0, 1, 2, 3, 4, 5, 3, 4, 5, 6]
    assert stats.deadlettered == 0 and stats.retries == 1
    assert _committed(kafka_bootstrap, r.cfg.group, topic) == len(values)


class RefuseAll(BaseHandler):
    def handle(self, rec: Record, ctx: Context) -> None:
        raise PermanentError("refused for good")


@pytest.mark.timeout(60)
def test_a_big_dead_letter_names_the_original_size_and_hash(kafka_bootstrap: str) -> None:
    """One bound for every dead letter (DeadLetter.of): the sinks' runtime used to cut a
    payload at 512 KiB first, so a 700 KB message's letter named 512 KiB as its size and
    the hash of the head, and nobody could find the original by it."""
    import hashlib

    topic, dl = _topics(kafka_bootstrap)
    big = bytes(range(256)) * (700_000 // 256)
    _produce(kafka_bootstrap, topic, [big])
    stats = _runner(kafka_bootstrap, topic, dl, RefuseAll(), exit_when_idle_s=1.0).run()
    assert stats.deadlettered == 1
    (letter,) = _letters(kafka_bootstrap, dl, 1)
    assert letter.truncated and letter.payload() == big[: len(letter.payload())]
    assert letter.payload_bytes == len(big)
    assert letter.payload_sha256 == hashlib.sha256(big).hexdigest()
    assert letter.reason == "refused for good"
