"""The worker over TLS + SASL against a real broker (issue 12, defect 5: the worker
passed SASL credentials only and ignored ``security.protocol``, so it could not reach a
TLS listener). A private local broker gets a SASL_SSL listener (PEM key and CA made with
openssl); the worker, the trace producer and the reader use only that listener."""

from __future__ import annotations

import shutil
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from c4base.kafka import KafkaConfig
from compose.local_broker import LocalKafka
from streams.commands import decode_command
from streams.worker import start_worker_process
from tests.chaos.harness import TRUTH, as_messages, trace, worker_config

pytestmark = [pytest.mark.kafka, pytest.mark.chaos_long]


def make_certs(d: Path) -> dict[str, Path]:
    def run(*a: str) -> None:
        subprocess.run(a, cwd=d, check=True, capture_output=True)

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=c4-test-ca", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", "broker.key", "-out", "broker.csr")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("openssl", "x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", "broker.pem")  # fmt: skip
    keystore = d / "broker-keystore.pem"  # PKCS#8 key + certificate, as Kafka reads PEM
    keystore.write_text((d / "broker.key").read_text() + (d / "broker.pem").read_text())
    return {"ca": d / "ca.pem", "keystore": keystore}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_worker_finds_the_fault_over_sasl_ssl_only(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    certs = make_certs(tmp_path)
    port = free_port()
    jaas = (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        'user_c4-worker="worker-pw" user_c4-exporter="exporter-pw";'
    )
    broker = LocalKafka(
        secure_listener={
            "port": str(port),
            "sasl.enabled.mechanisms": "PLAIN",
            "listener.name.sasl_ssl.plain.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(certs["keystore"]),
        }
    )
    broker.start()
    try:
        secure = f"127.0.0.1:{port}"

        def client(user: str, pw: str) -> dict[str, str]:
            return {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "PLAIN",
                "sasl.username": user,
                "sasl.password": pw,
                "ssl.ca.location": str(certs["ca"]),
            }

        # A wrong password is refused: the listener really authenticates.
        bad = AdminClient({"bootstrap.servers": secure, **client("c4-worker", "nope")})
        with pytest.raises(KafkaException):
            bad.list_topics(timeout=5)

        cfg = worker_config(
            secure,
            tmp_path / "w",
            kafka=KafkaConfig(
                bootstrap=secure,
                topic_prefix=f"tls{uuid.uuid4().hex[:6]}.",
                extra=client("c4-worker", "worker-pw"),
            ),
        )
        exporter = client("c4-exporter", "exporter-pw")
        with start_worker_process(cfg) as w:
            w.wait_ready(120)
            p = Producer({"bootstrap.servers": secure, **exporter, "linger.ms": 5})
            for key, value in as_messages(trace()):
                p.produce(cfg.topics().events, key=key, value=value)
            assert p.flush(30) == 0
            c = Consumer(
                {"bootstrap.servers": secure, **exporter, "group.id": f"r{uuid.uuid4().hex}"}
            )
            c.assign([TopicPartition(cfg.topics().isolations, 0, 0)])
            cmds = []
            for _ in range(150):
                cmds += [decode_command(m.value()) for m in c.consume(10, 0.2) if not m.error()]
                if cmds:
                    break
            c.close()
            assert w.stop() == 0
        assert [(x.host, x.gpu, x.fault) for x in cmds] == [TRUTH], w.log_tail()
    finally:
        broker.stop()
