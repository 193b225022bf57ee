"""Small helpers shared by tests that read back what a component published."""

from __future__ import annotations

import time
import uuid

from confluent_kafka import Consumer, Message

from c4base.kafka import KafkaConfig


def consume(bootstrap: str, topic: str, expect: int, timeout: float = 30.0) -> list[Message]:
    """All messages of ``topic`` (every partition): waits for ``expect`` messages, then
    for 1 s without a new one, so a test also sees what should *not* have arrived."""
    c = Consumer(KafkaConfig(bootstrap=bootstrap).consumer_config(f"t-{uuid.uuid4().hex[:8]}"))
    c.subscribe([topic])
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    quiet_until: float | None = None
    try:
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is not None and msg.error() is None:
                out.append(msg)
                quiet_until = None
                continue
            if len(out) >= expect:
                quiet_until = quiet_until or time.monotonic() + 1.0
                if time.monotonic() >= quiet_until:
                    break
    finally:
        c.close()
    return out
