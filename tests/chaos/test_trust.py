"""Trust: the worker speaks TLS/SASL like every service; the broker is not exposed;
forged commands and missing ``dry_run`` never act; the actuator has its own cap and
deduplicates by fault identity (issue 12, defects 5 and 6)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
import yaml

from c4base.kafka import KafkaConfig
from sinks.actuator.config import ActuatorConfig
from sinks.actuator.consumer import Actuator
from sinks.actuator.ledger import Ledger
from streams.app.faust_app import WorkerSecurityError, worker_credentials
from streams.app.settings import WorkerConfig
from streams.commands import CommandDecodeError, IsolationCommand, decode_command, encode_command
from tests.chaos.harness import Recording

ROOT = Path(__file__).resolve().parents[2]


def test_compose_binds_the_unauthenticated_broker_to_loopback() -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    ports = compose["services"]["kafka"]["ports"]
    assert ports and all(str(p).startswith("127.0.0.1:") for p in ports)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A self-signed CA and a client certificate made with the system's openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("certs")
    run = lambda *a: subprocess.run(a, cwd=d, check=True, capture_output=True)  # noqa: E731
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-subj", "/CN=c4-test-ca", "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=c4-worker",
        "-keyout", "client.key", "-out", "client.csr")  # fmt: skip
    run("openssl", "x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-out", "client.pem")  # fmt: skip
    return {k: str(d / f) for k, f in [("ca", "ca.pem"), ("cert", "client.pem"),
                                        ("key", "client.key")]}  # fmt: skip


def worker(extra: dict[str, str]) -> WorkerConfig:
    return WorkerConfig(kafka=KafkaConfig(extra=extra))


def test_worker_builds_tls_and_sasl_credentials_from_the_shared_kafka_settings(
    certs: dict[str, str],
) -> None:
    import faust

    mtls = worker_credentials(
        worker(
            {
                "security.protocol": "SSL",
                "ssl.ca.location": certs["ca"],
                "ssl.certificate.location": certs["cert"],
                "ssl.key.location": certs["key"],
            }
        )
    )
    assert isinstance(mtls, faust.SSLCredentials)
    ctx: ssl.SSLContext = mtls.context
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert any(c["subject"] == ((("commonName", "c4-test-ca"),),) for c in ctx.get_ca_certs())

    sasl = worker_credentials(
        worker(
            {
                "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512",
                "sasl.username": "c4-worker",
                "sasl.password": "s3cret",
                "ssl.ca.location": certs["ca"],
            }
        )
    )
    assert isinstance(sasl, faust.SASLCredentials)
    assert sasl.protocol.value == "SASL_SSL" and sasl.ssl_context is not None
    assert sasl.mechanism.value == "SCRAM-SHA-512" and sasl.username == "c4-worker"
    assert worker_credentials(worker({})) is None


def test_worker_refuses_sasl_passwords_over_plaintext_by_accident() -> None:
    with pytest.raises(WorkerSecurityError, match="security.protocol is PLAINTEXT"):
        worker_credentials(worker({"sasl.username": "u", "sasl.password": "p"}))
    with pytest.raises(WorkerSecurityError, match="not supported"):
        worker_credentials(worker({"security.protocol": "TLS1"}))


# ------------------------------------------------------------------ forged commands


def cmd(**kw: object) -> IsolationCommand:
    base: dict = dict(
        id="c4-1", ts_us=1, job="j", host="node-1", fault="noncomm_hang", action="cordon",
        confidence=0.9, reason="r", evidence={}, gpu=1, dry_run=False,
    )  # fmt: skip
    base.update(kw)
    return IsolationCommand(**base)


def test_a_command_without_dry_run_never_acts(tmp_path: Path) -> None:
    backend = Recording()
    with Ledger(tmp_path / "l.sqlite3") as led:
        act = Actuator(ActuatorConfig(execute=True), backend, led)
        h = act.handle(cmd(dry_run=None))
    assert h.decision == "dry_run" and backend.applied == []


def test_the_same_fault_under_a_new_id_acts_once(tmp_path: Path) -> None:
    # A worker SIGKILLed right after a decision re-decided it under a new id; the
    # actuator deduplicated by id only and cordoned twice.
    backend = Recording()
    with Ledger(tmp_path / "l.sqlite3") as led:
        act = Actuator(ActuatorConfig(execute=True), backend, led)
        first = act.handle(cmd(id="c4-a"))
        again = act.handle(cmd(id="c4-b"))
        other_gpu = act.handle(cmd(id="c4-c", gpu=2))
    assert (first.decision, again.decision, other_gpu.decision) == ("act", "duplicate", "act")
    assert backend.applied == ["node-1", "node-1"]


def test_the_actuator_caps_actions_per_job_per_hour(tmp_path: Path) -> None:
    backend = Recording()
    with Ledger(tmp_path / "l.sqlite3") as led:
        act = Actuator(ActuatorConfig(execute=True, max_actions_per_job_per_hour=2), backend, led)
        got = [act.handle(cmd(id=f"c4-{i}", host=f"node-{i}")).decision for i in range(4)]
        other_job = act.handle(cmd(id="c4-x", job="k", host="node-9")).decision
    assert got == ["act", "act", "capped", "capped"] and other_job == "act"
    assert backend.applied == ["node-0", "node-1", "node-9"]


@pytest.mark.parametrize("host", ["--all", "*", "../../etc", "node-1\nnode-2", "a b", "-x", ""])
def test_commands_naming_no_host_are_refused_before_any_backend(host: str) -> None:
    good = json.loads(encode_command(cmd()))
    raw = json.dumps({**good, "host": host}).encode()
    with pytest.raises(CommandDecodeError, match="host"):
        decode_command(raw)
