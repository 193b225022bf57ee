"""Contract events through the real broker: byte-identical, in order, decodable."""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, Producer

from c4base.kafka import KafkaConfig
from producers.events import Conn, OpEvent, ProgressEvent, decode_message, encode_message


def _batch(comm: str, n: int) -> list[OpEvent | ProgressEvent]:
    out: list[OpEvent | ProgressEvent] = []
    for i in range(n):
        conn = Conn(peer=(i + 1) % 16, dir="send", bytes=1 << 19, time_us=400.0)
        out.append(OpEvent(v=1, job="j", comm=comm, nranks=16, rank=i % 16, host=f"node-{i % 4}",
                           gpu=i % 8, nic="mlx5_0", ts_us=1_750_000_000_000_000 + i, op="AllReduce",
                           seq=i, bytes=1 << 20, exec_us=812.5 + i,
                           conns=[conn]))  # fmt: skip
        out.append(ProgressEvent(v=1, job="j", comm=comm, nranks=16, rank=i % 16,
                                 host=f"node-{i % 4}", ts_us=1_750_000_000_000_000 + i,
                                 started=i + 1, completed=i, inflight_op="AllReduce",
                                 inflight_us=12.0))  # fmt: skip
    return out


@pytest.mark.kafka
@pytest.mark.timeout(60)
def test_contract_batches_come_back_byte_identical(kafka_bootstrap: str, make_topics) -> None:
    topic = make_topics({"events": 4})["events"]
    kafka = KafkaConfig(bootstrap=kafka_bootstrap)
    # The exporters' producer settings: idempotent, zstd-compressed, batched.
    producer = Producer(kafka.producer_config())
    sent: dict[str, list[bytes]] = {}
    for c in range(6):
        comm = f"0x{c:04x}"
        for k in range(5):
            value = encode_message(_batch(comm, 20 + k))
            sent.setdefault(comm, []).append(value)
            producer.produce(topic, value=value, key=comm.encode())
    assert producer.flush(30) == 0

    consumer = Consumer(kafka.consumer_config("roundtrip"))
    consumer.subscribe([topic])
    got: dict[str, list[bytes]] = {}
    want = sum(map(len, sent.values()))
    try:
        for _ in range(300):
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                got.setdefault(msg.key().decode(), []).append(msg.value())
            if sum(map(len, got.values())) == want:
                break
    finally:
        consumer.close()
    # Same bytes, in order per communicator (one key → one partition).
    assert got == sent
    for comm, values in got.items():
        for i, v in enumerate(values):
            assert decode_message(v) == _batch(comm, 20 + i)
