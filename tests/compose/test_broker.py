"""The local Kafka broker: round-trips bytes, honours partition counts, cleans up."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections import defaultdict
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient

from compose.local_broker import BrokerError, LocalKafka, scram_arguments

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(120)
def test_bytes_round_trip_in_order_per_partition(
    kafka_bootstrap: str, make_topics: Callable[..., dict[str, str]]
) -> None:
    topic = make_topics({"roundtrip": 3})["roundtrip"]
    # Arbitrary bytes (incl. NUL, invalid UTF-8, empty) must survive untouched.
    sent: dict[bytes, list[bytes]] = {}
    producer = Producer(
        {"bootstrap.servers": kafka_bootstrap, "linger.ms": 5, "enable.idempotence": True}
    )
    for k in range(6):
        key = b"comm-\x00\xff" + bytes([k])
        sent[key] = [os.urandom(k * 10) + i.to_bytes(4, "big") for i in range(50)]
        for value in sent[key]:
            producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0

    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"test-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got: dict[bytes, list[bytes]] = defaultdict(list)
    partitions_of: dict[bytes, set[int]] = defaultdict(set)
    total = sum(len(v) for v in sent.values())
    n = 0
    try:
        while n < total:
            msg = consumer.poll(10)
            assert msg is not None, f"timed out after {n}/{total} messages"
            if msg.error():
                assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                continue
            got[msg.key()].append(msg.value())
            partitions_of[msg.key()].add(msg.partition())
            n += 1
    finally:
        consumer.close()

    # Same key -> same partition, so per-key order is per-partition order.
    assert dict(got) == sent
    assert all(len(p) == 1 for p in partitions_of.values())
    assert len(set().union(*partitions_of.values())) > 1  # keys really spread out


@pytest.mark.timeout(60)
def test_topics_have_explicit_partition_counts(
    kafka_bootstrap: str, make_topics: Callable[..., dict[str, str]]
) -> None:
    names = make_topics({"three": 3, "seven": 7, "one": 1})
    md = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
    counts = {key: len(md.topics[name].partitions) for key, name in names.items()}
    assert counts == {"three": 3, "seven": 7, "one": 1}
    for name in names.values():
        assert all(p.leader >= 0 for p in md.topics[name].partitions.values())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie isn't a survivor; anything else with this pid is.
    state = subprocess.run(
        ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True
    ).stdout.strip()
    return bool(state) and not state.startswith("Z")


@pytest.mark.timeout(90)
def test_stop_leaves_no_process_and_no_data() -> None:
    if os.environ.get("KAFKA_BOOTSTRAP"):
        pytest.skip("external cluster in use; not starting a local broker")
    with LocalKafka() as kafka:
        pid = kafka.pid
        workdir = kafka.workdir
        assert pid is not None and workdir is not None and workdir.is_dir()
        assert kafka.bootstrap.startswith("127.0.0.1:")
        assert (workdir / "data").is_dir()
    assert not _alive(pid)
    assert not workdir.exists()
    # Nothing else is left in the broker's process group either.
    assert subprocess.run(["pgrep", "-g", str(pid)], capture_output=True).returncode == 1


def test_scram_users_become_format_arguments_and_reserved_characters_are_refused() -> None:
    """``kafka-storage format --add-scram`` splits on ``,`` ``]`` ``=``: a password holding
    one would silently become another user or password, so it is refused."""
    assert scram_arguments({"c4-worker": "pw-1", "c4-actuator": "pw.2"}) == [
        "--add-scram",
        "SCRAM-SHA-512=[name=c4-worker,password=pw-1]",
        "--add-scram",
        "SCRAM-SHA-512=[name=c4-actuator,password=pw.2]",
    ]
    for users in ({"u": "a,b"}, {"u": "a]b"}, {"u": "a=b"}, {"u v": "pw"}, {"u": "a b"}):
        with pytest.raises(BrokerError):
            scram_arguments(users)
