"""The alerter on the real Kafka broker: commands and verdicts in, grouped alerts out."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import uuid

import msgspec
import pytest

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.topics import Topics
from compose.local_broker import create_topics
from sinks.alert.config import AlertConfig, Destination
from sinks.alert.consumer import AlertService
from sinks.alert.samples import sample_command
from streams.commands import encode_command
from streams.verdicts import Verdict, encode_verdict
from tests.sinks.test_alert_support import (
    WebhookServer,
    webhook_server_fixture,  # noqa: F401 (the fixture)
)


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_consumer_groups_routes_resolves_and_dead_letters(
    kafka_bootstrap: str, webhook_server: WebhookServer
) -> None:
    from confluent_kafka import Consumer, Producer

    topics = Topics(prefix=f"alert-{uuid.uuid4().hex[:8]}.")
    create_topics(kafka_bootstrap, topics.partitions(), 30.0)
    kafka = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix)

    producer = Producer(kafka.producer_config())
    for i in range(3):  # three decisions about h1, one of them delivered twice
        cmd = msgspec.structs.replace(sample_command("h1"), id=f"c{i}")
        producer.produce(topics.isolations, encode_command(cmd), key=b"h1")
    producer.produce(topics.isolations, encode_command(sample_command("h1", id="c0")), key=b"h1")
    producer.produce(topics.isolations, b'{"not": "a command"}', key=b"h9")
    verdict = Verdict(
        id="v1",
        ts_us=1,
        job="j",
        comm="0xa",
        host="h2",
        fault="slow_link",
        score=0.95,
        reason="link h2-h4 at 30% of its peers",
        window_start_us=0,
        window_end_us=1,
        peer_host="h4",
    )
    producer.produce(topics.verdicts, encode_verdict(verdict), key=b"h2")
    assert producer.flush(10) == 0

    cfg = AlertConfig(
        destination=[
            Destination(type="mattermost", url=webhook_server.url("/mm"), min_severity="info"),
            Destination(type="discord", url=webhook_server.url("/dc"), min_severity="critical"),
        ],
        resolve_timeout_s=2.0,
    )

    t0 = time.monotonic()
    consumer = AlertService(
        cfg,
        kafka,
        topics=topics,
        group=f"g-{uuid.uuid4().hex[:6]}",
        from_beginning=True,
        instance_id="",
        tick_s=0.2,
    )
    t = threading.Thread(target=consumer.run)
    t.start()
    try:
        # 2 firing + 2 resolved to Mattermost, firing + resolved of h1 to Discord.
        webhook_server.wait_for(6, 60.0)
        time.sleep(0.5)  # nothing more should arrive
    finally:
        consumer.stop.set()
        t.join(30)
    mm = [r.json["text"] for r in webhook_server.at("/mm")]
    dc = [r.json["embeds"][0]["title"] for r in webhook_server.at("/dc")]
    assert sorted(t.split(" (job")[0] for t in mm) == [
        "#### [FIRING:critical] straggler on h1",
        "#### [FIRING:warning] slow_link on h2",
        "#### [RESOLVED:critical] straggler on h1",
        "#### [RESOLVED:warning] slow_link on h2",
    ]
    assert [t.split(" (job")[0] for t in dc] == [
        "[FIRING:critical] straggler on h1",
        "[RESOLVED:critical] straggler on h1",
    ]
    assert consumer.stats.commands == 4 and consumer.stats.verdicts == 1
    assert consumer.stats.deadlettered == 1
    assert consumer.alerter.grouper.stats.duplicates == 1
    assert time.monotonic() - t0 < 60

    dlq = Consumer(kafka.consumer_config(f"dlq-{uuid.uuid4().hex[:6]}"))
    dlq.subscribe([topics.deadletter])
    msgs = []
    deadline = time.monotonic() + 20
    while not msgs and time.monotonic() < deadline:
        msgs = [m for m in dlq.consume(10, 0.5) if m.error() is None]
    dlq.close()
    (rec,) = [DeadLetter.decode(m.value()) for m in msgs]
    assert rec.stage == "alerter" and rec.payload() == b'{"not": "a command"}' and rec.key == "h9"
    assert rec.source.startswith(topics.isolations)


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_undelivered_dead_letter_stops_the_alerter_without_committing_past_it(
    kafka_bootstrap: str, webhook_server: WebhookServer
) -> None:
    """Issue 9 defect 2: the dead-letter topic refuses the letter (its max.message.bytes
    is smaller than the letter). The alerter must stop with an error and leave the bad
    message uncommitted (it is read again after the fix), never commit past it."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from c4base.kafka_admin import create_topics as create_with_config
    from c4base.runtime import DeadLetterError

    topics = Topics(prefix=f"alertdl-{uuid.uuid4().hex[:8]}.")
    create_topics(kafka_bootstrap, {topics.isolations: 1, topics.verdicts: 1}, 30.0)
    create_with_config(
        kafka_bootstrap, {topics.deadletter: 1}, 30.0, config={"max.message.bytes": "1000"}
    )
    kafka = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix)
    producer = Producer(kafka.producer_config())
    pad = base64.b64encode(os.urandom(3000))  # incompressible: the letter stays > 1000 B
    producer.produce(topics.isolations, b'{"not": "a command", "pad": "' + pad + b'"}')
    producer.produce(topics.isolations, encode_command(sample_command("h1")), key=b"h1")
    assert producer.flush(10) == 0

    cfg = AlertConfig(destination=[Destination(type="mattermost", url=webhook_server.url("/mm"))])
    group = f"g-{uuid.uuid4().hex[:6]}"
    svc = AlertService(cfg, kafka, topics=topics, group=group, from_beginning=True, instance_id="")
    with pytest.raises(DeadLetterError, match="not delivered"):
        svc.run()
    c = Consumer(kafka.consumer_config(group))
    (tp,) = c.committed([TopicPartition(topics.isolations, 0)], timeout=10)
    c.close()
    assert tp.offset < 1  # not past the bad message at offset 0


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_consumer_reads_the_actuators_outcomes(
    kafka_bootstrap: str, webhook_server: WebhookServer
) -> None:
    """The actuator's c4.actions record reaches the host's alert (issue 13, defect 6)."""
    from confluent_kafka import Producer

    from sinks.actuator.outcomes import encode_report, new_report

    topics = Topics(prefix=f"alert-{uuid.uuid4().hex[:8]}.")
    create_topics(kafka_bootstrap, topics.partitions(), 30.0)
    kafka = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=topics.prefix)
    cmd = sample_command("h1")
    report = new_report(
        command_id=cmd.id, job=cmd.job, host=cmd.host, node=cmd.host, action=cmd.action,
        fault=cmd.fault, decision="act", status="failed",
        detail="gave up after 3 attempt(s): scontrol timed out",
    )  # fmt: skip
    producer = Producer(kafka.producer_config())
    producer.produce(topics.isolations, encode_command(cmd), key=b"h1")
    producer.produce(topics.actions, encode_report(report), key=b"h1")
    assert producer.flush(10) == 0
    cfg = AlertConfig(
        destination=[
            Destination(type="mattermost", url=webhook_server.url("/mm"), min_severity="info")
        ],
        resolve_timeout_s=30.0,
    )
    svc = AlertService(
        cfg,
        kafka,
        topics=topics,
        group=f"g-{uuid.uuid4().hex[:6]}",
        from_beginning=True,
        instance_id="",
        tick_s=0.2,
    )
    t = threading.Thread(target=svc.run)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            "Actuator: failed" in json.dumps(r.json) for r in webhook_server.at("/mm")
        ):
            time.sleep(0.2)
    finally:
        svc.stop.set()
        t.join(30)
    texts = [json.dumps(r.json) for r in webhook_server.at("/mm")]
    assert any("Actuator: failed (gave up after 3 attempt(s)" in t for t in texts), texts
