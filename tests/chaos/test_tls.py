"""The services over TLS against a real broker (issue 12, defect 5: the worker passed
SASL credentials only and ignored ``security.protocol``, so it could not reach a TLS
listener). A private local broker gets one secure listener (PEM keys and a test CA made
with openssl) and the clients use only that listener:

* SASL PLAIN over TLS: the worker finds the fault;
* mutual TLS (``ssl.client.auth=required``, a client certificate from the test CA) and
  SASL_SSL with SCRAM-SHA-512 (the user written into KRaft's metadata at format time):
  replay publishes the trace through the real CLI, the worker finds the fault, the
  actuator's CLI consumes the command; a client without a certificate / with a wrong
  password is refused;
* wrong credentials: worker, replay and actuator each stop at once with a non-zero
  status and the broker's reason, and the password is in none of their output.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from c4base.kafka import KafkaConfig
from c4base.lifeguard import EXIT_CREDENTIALS_REFUSED
from compose.local_broker import LocalKafka
from producers.events import encode_message
from streams.commands import decode_command
from streams.worker import start_worker_process
from tests.chaos.harness import TRUTH, as_messages, trace, worker_config

pytestmark = [pytest.mark.kafka, pytest.mark.chaos_long]

CLI = [sys.executable, "-c", "from c4stream.cli import main; main()"]
SCRAM_PASSWORD = "scram-Pw-7c1d"  # the test user's; looked for in every log below
WRONG_PASSWORD = "wrong-Pw-93ab"


def make_certs(d: Path) -> dict[str, Path]:
    """A test CA, the broker's certificate (SAN 127.0.0.1) and a client certificate."""

    def run(*a: str) -> None:
        subprocess.run(a, cwd=d, check=True, capture_output=True)

    def signed(name: str, cn: str) -> None:
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")  # fmt: skip
        run("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey",
            "ca.key", "-CAcreateserial", "-days", "2", "-extfile", "san.ext",
            "-out", f"{name}.pem")  # fmt: skip

    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=c4-test-ca", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    signed("broker", "127.0.0.1")
    signed("client", "c4-client")
    keystore = d / "broker-keystore.pem"  # PKCS#8 key + certificate, as Kafka reads PEM
    keystore.write_text((d / "broker.key").read_text() + (d / "broker.pem").read_text())
    return {
        "ca": d / "ca.pem",
        "keystore": keystore,
        "client_cert": d / "client.pem",
        "client_key": d / "client.key",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def need_openssl() -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")


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


# ------------------------------------------------------------------ mTLS and SCRAM


class Secure:
    """A broker with one secure listener and the client settings of ``mode``."""

    def __init__(self, mode: str, certs: dict[str, Path], broker: LocalKafka, port: int):
        self.mode, self.certs, self.broker = mode, certs, broker
        self.bootstrap = f"127.0.0.1:{port}"

    def extra(self, *, good: bool = True) -> dict[str, str]:
        """librdkafka client settings; ``good=False``: no certificate / a wrong password
        (the password itself goes through the environment, as docs/security.md says)."""
        ca = {"ssl.ca.location": str(self.certs["ca"])}
        if self.mode == "mtls":
            mine = {
                "ssl.certificate.location": str(self.certs["client_cert"]),
                "ssl.key.location": str(self.certs["client_key"]),
            }
            return {"security.protocol": "SSL", **ca, **(mine if good else {})}
        return {
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "c4-svc",
            **ca,
        }

    def password(self, *, good: bool = True) -> str | None:
        if self.mode == "mtls":
            return None
        return SCRAM_PASSWORD if good else WRONG_PASSWORD

    def client(self, *, good: bool = True) -> dict[str, str]:
        pw = self.password(good=good)
        return {
            "bootstrap.servers": self.bootstrap,
            **self.extra(good=good),
            **({"sasl.password": pw} if pw else {}),
        }

    def toml(self, path: Path, prefix: str, *, good: bool = True) -> Path:
        lines = ["[kafka]", f'bootstrap = "{self.bootstrap}"', f'topic_prefix = "{prefix}"', ""]
        lines += ["[kafka.extra]", *(f'"{k}" = "{v}"' for k, v in self.extra(good=good).items())]
        path.write_text("\n".join(lines) + "\n")
        return path

    def env(self, *, good: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP"}
        pw = self.password(good=good)
        if pw:
            env["C4STREAM__KAFKA__EXTRA__SASL.PASSWORD"] = pw
        return env


@pytest.fixture(scope="module", params=["mtls", "scram-sha-512"])
def secure(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Secure]:
    need_openssl()
    mode = request.param
    certs = make_certs(tmp_path_factory.mktemp(f"certs-{mode}"))
    port = free_port()
    tls = {"ssl.keystore.type": "PEM", "ssl.keystore.location": str(certs["keystore"])}
    if mode == "mtls":
        listener = {
            "protocol": "SSL",
            "ssl.client.auth": "required",
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(certs["ca"]),
            **tls,
        }
        broker = LocalKafka(secure_listener={"port": str(port), **listener})
    else:
        jaas = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        listener = {
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            **tls,
        }
        broker = LocalKafka(
            secure_listener={"port": str(port), **listener},
            scram_users={"c4-svc": SCRAM_PASSWORD},
        )
    broker.start()
    try:
        yield Secure(mode, certs, broker, port)
    finally:
        broker.stop()


def write_trace(path: Path) -> Path:
    """The chaos trace as contract lines (one JSON array per batch), for ``replay``."""
    path.write_bytes(b"".join(encode_message(b) + b"\n" for b in trace()))
    return path


@pytest.mark.timeout(240)
def test_replay_worker_and_actuator_over_the_secure_listener(
    secure: Secure, tmp_path: Path
) -> None:
    # The listener really checks: no certificate / a wrong password is refused.
    bad = AdminClient(secure.client(good=False))
    with pytest.raises(KafkaException):
        bad.list_topics(timeout=5)
    assert AdminClient(secure.client()).list_topics(timeout=10).brokers

    prefix = f"s{uuid.uuid4().hex[:6]}."
    kafka = KafkaConfig(bootstrap=secure.bootstrap, topic_prefix=prefix, extra=secure.client())
    kafka.extra.pop("bootstrap.servers")
    cfg = worker_config(secure.bootstrap, tmp_path / "w", kafka=kafka)
    toml = secure.toml(tmp_path / "c4stream.toml", prefix)
    with start_worker_process(cfg) as w:
        w.wait_ready(120)
        t0 = time.monotonic()
        rp = subprocess.run(
            [*CLI, "replay", str(write_trace(tmp_path / "trace.jsonl")), "--config", str(toml),
             "--speed", "max", "--no-progress"],
            env=secure.env(), capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert rp.returncode == 0, rp.stderr[-3000:]
        assert f"acknowledged {len(trace())}/{len(trace())}" in rp.stderr, rp.stderr[-2000:]
        c = Consumer({**secure.client(), "group.id": f"r{uuid.uuid4().hex}"})
        c.assign([TopicPartition(cfg.topics().isolations, 0, 0)])
        cmds = []
        while not cmds and time.monotonic() - t0 < 60:
            cmds += [decode_command(m.value()) for m in c.consume(10, 0.2) if not m.error()]
        c.close()
        assert w.stop() == 0
    assert [(x.host, x.gpu, x.fault) for x in cmds] == [TRUTH], w.log_tail()

    # A sink through c4base's client config: the actuator consumes the command.
    act = subprocess.run(
        [*CLI, "actuate", "--config", str(toml), "--backend", "command",
         "--command-template", "true {host}", "--ledger", str(tmp_path / "ledger.db"),
         "--instance-id", "", "--exit-when-idle", "4", "--broker-timeout", "30"],
        env=secure.env(), capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert act.returncode == 0, act.stderr[-3000:]
    assert "received=1," in act.stderr and "handled=1," in act.stderr, act.stderr[-2000:]
    for out in (rp.stderr, act.stderr, w.log_path.read_text()):
        assert SCRAM_PASSWORD not in out


@pytest.mark.timeout(120)
def test_wrong_credentials_stop_each_service_with_a_clear_error(
    secure: Secure, tmp_path: Path
) -> None:
    """Worker, replay and actuator at once (bounded: each stops within seconds)."""
    prefix = f"b{uuid.uuid4().hex[:6]}."
    toml = secure.toml(tmp_path / "c4stream.toml", prefix, good=False)
    bad = secure.client(good=False)
    bad.pop("bootstrap.servers")
    cfg = worker_config(
        secure.bootstrap,
        tmp_path / "w",
        kafka=KafkaConfig(bootstrap=secure.bootstrap, topic_prefix=prefix, extra=bad),
    )
    t0 = time.monotonic()
    w = start_worker_process(cfg)
    procs = {
        name: subprocess.Popen(
            [*CLI, *argv, "--config", str(toml)],
            env=secure.env(good=False),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, argv in {
            "replay": [
                "replay",
                str(write_trace(tmp_path / "t.jsonl")),
                "--speed",
                "max",
                "--no-progress",
            ],
            "actuate": [
                "actuate",
                "--backend",
                "command",
                "--command-template",
                "true {host}",
                "--ledger",
                str(tmp_path / "l.db"),
                "--instance-id",
                "",
                "--broker-timeout",
                "300",
            ],
        }.items()  # fmt: skip
    }
    outs = {}
    try:
        for name, p in procs.items():
            outs[name] = (p.communicate(timeout=60)[0], p.returncode)
        outs["worker"] = (None, w.proc.wait(60))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        w.stop(5)
    took = time.monotonic() - t0
    outs["worker"] = (w.log_path.read_text(), outs["worker"][1])
    print(f"\n{secure.mode}: all stopped in {took:.1f}s: "
          + ", ".join(f"{k} exit {rc}" for k, (_, rc) in outs.items()))  # fmt: skip
    assert outs["worker"][1] == EXIT_CREDENTIALS_REFUSED, outs["worker"][0][-3000:]
    assert outs["replay"][1] == 1 and outs["actuate"][1] == 1, outs
    for name, (out, _) in outs.items():
        assert "refused" in out and "credentials" in out, (name, out[-3000:])
        assert WRONG_PASSWORD not in out and SCRAM_PASSWORD not in out, name
    assert took < 60  # not the 300 s broker timeout: refused credentials stop at once
