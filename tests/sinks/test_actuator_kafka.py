"""The actuator end to end through the real broker: redelivery, restarts, safety rules.

The cluster is the command backend running a small script that appends one JSON line
per call to a file: a line per action, so "acted once" is "one line".
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from sinks.actuator.command_backend import CommandBackend
from sinks.actuator.config import ActuatorConfig, CommandSettings
from sinks.actuator.consumer import run
from sinks.actuator.ledger import Ledger
from streams.commands import IsolationCommand, encode_command

pytestmark = pytest.mark.kafka

RECORDER = """\
import json, sys
with open(sys.argv[1], "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\\n")
"""


def command(**kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id="c4-a",
        ts_us=1,
        job="j",
        host="node001",
        fault="straggler",
        action="cordon",
        confidence=0.9,
        reason="node001 GPU 5 arrives last",
        evidence={},
        dry_run=False,  # absent means dry run
    )
    base.update(kw)
    return IsolationCommand(**base)


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for v in values:
        p.produce(topic, v, key=b"node")
    assert p.flush(30) == 0


def consume_all(bootstrap: str, topic: str, expect: int, timeout: float = 20.0) -> list[bytes]:
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
        }
    )
    c.subscribe([topic])
    out: list[bytes] = []
    try:
        for msg in iter(lambda: c.poll(timeout), None):
            if msg.error() is None:
                out.append(msg.value())
            if len(out) >= expect:
                break
    finally:
        c.close()
    return out


@pytest.fixture
def recorder(tmp_path: Path) -> tuple[str, Path]:
    """(command template, file of calls)."""
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    out = tmp_path / "actions.jsonl"
    prog = " ".join(shlex.quote(str(p)) for p in (sys.executable, script, out))
    return f"{prog} drain {{host}} {{id}}", out


def actions(out: Path) -> list[list[str]]:
    return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []


@pytest.mark.timeout(90)
def test_redelivery_and_restart_act_once(
    kafka_bootstrap: str,
    make_topics: Callable[..., dict[str, str]],
    recorder: tuple[str, Path],
    tmp_path: Path,
) -> None:
    topics = make_topics({"isolations": 1, "deadletter": 1})
    tmpl, out = recorder
    a, b = command(), command(id="c4-b", host="node002")
    produce(
        kafka_bootstrap,
        topics["isolations"],
        [encode_command(a), encode_command(a), b'{"v":1,"kind":"isolate"}', encode_command(b)],
    )
    ledger = tmp_path / "ledger.sqlite3"

    def actuate(group: str, *extra: str) -> subprocess.Popen[str]:
        argv = [
            *(sys.executable, "-c", "from c4stream.cli import main; main()", "actuate"),
            *("--bootstrap", kafka_bootstrap, "--backend", "command", "--execute"),
            *("--command-template", tmpl, "--ledger", str(ledger), "--group", group),
            *("--isolations-topic", topics["isolations"]),
            *("--deadletter-topic", topics["deadletter"]),
            *extra,
        ]
        env = {**os.environ, "KAFKA_BOOTSTRAP": kafka_bootstrap}
        return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)

    # First run: stopped with SIGTERM once both actions are seen.
    first = actuate(f"{topics['isolations']}-actuator-1")
    deadline = time.monotonic() + 40
    while len(actions(out)) < 2 and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    _, stderr = first.communicate(timeout=20)
    assert first.returncode == 0, stderr
    assert actions(out) == [["drain", "node001", "c4-a"], ["drain", "node002", "c4-b"]]
    assert "received 4, invalid 1, acted 2, duplicate 1" in stderr

    # The same command once more, and a restart under a new group, which re-reads the
    # topic from the start as if the committed offsets were lost: nothing acts again.
    produce(kafka_bootstrap, topics["isolations"], [encode_command(a)])
    second = actuate(f"{topics['isolations']}-actuator-2", "--exit-when-idle", "1.5")
    _, stderr = second.communicate(timeout=40)
    assert second.returncode == 0, stderr
    assert "received 5, invalid 1, duplicate 4" in stderr
    assert len(actions(out)) == 2
    with Ledger(ledger) as led:
        assert led.get("c4-a").deliveries == 5  # type: ignore[union-attr]

    [dl] = [DeadLetter.decode(v) for v in consume_all(kafka_bootstrap, topics["deadletter"], 1)]
    assert dl.stage == "actuator" and dl.source == f"{topics['isolations']}[0]@2"
    assert dl.reason.startswith("invalid isolation command: Object missing required field")
    assert dl.payload() == b'{"v":1,"kind":"isolate"}'


@pytest.mark.timeout(60)
def test_deny_list_alert_only_and_dry_run_never_act(
    kafka_bootstrap: str,
    make_topics: Callable[..., dict[str, str]],
    recorder: tuple[str, Path],
    tmp_path: Path,
) -> None:
    topics = make_topics({"isolations": 1, "deadletter": 1})
    tmpl, out = recorder
    cmds = [
        command(id="denied", host="login-1"),
        command(id="alert", action="alert_only"),
        command(id="own-dry-run", dry_run=True),
        command(id="real", host="node009"),
    ]
    produce(kafka_bootstrap, topics["isolations"], [encode_command(c) for c in cmds])
    backend = CommandBackend(CommandSettings(template=tmpl))

    def cfg(group: str, execute: bool) -> ActuatorConfig:
        return ActuatorConfig(
            kafka=KafkaConfig(bootstrap=kafka_bootstrap),
            group=group,
            execute=execute,
            deny=("LOGIN-*",),
            isolations=topics["isolations"],
            deadletter=topics["deadletter"],
            exit_when_idle_s=1.0,
        )

    with Ledger(tmp_path / "ledger.sqlite3") as led:
        dry = run(cfg(f"{topics['isolations']}-dry", execute=False), backend, led)
        assert dry.received == 4 and actions(out) == []
        status = {e.id: e.status for e in led.entries()}
        assert status == {
            "denied": "skipped",
            "alert": "skipped",
            "own-dry-run": "dry_run",
            "real": "dry_run",
        }
        # The same commands to an actuator with --execute: only "real" acts; the
        # earlier dry run did not block it.
        live = run(cfg(f"{topics['isolations']}-live", execute=True), backend, led)
        assert live.by_decision == {"acted": 1, "alert_only": 1, "denied": 1, "dry_run": 1}
        assert actions(out) == [["drain", "node009", "real"]]


@pytest.mark.timeout(90)
def test_restart_after_sigkill_resumes_at_once_with_static_membership(
    kafka_bootstrap: str,
    make_topics: Callable[..., dict[str, str]],
    recorder: tuple[str, Path],
    tmp_path: Path,
) -> None:
    """Issue 12 item 8: without static membership a restarted actuator waited for the
    killed member's session (45 s) to expire. With group.instance.id (the default,
    GROUP@hostname) the new process takes the partition back at once."""
    topics = make_topics({"isolations": 1, "deadletter": 1})
    tmpl, out = recorder
    group = f"act-{uuid.uuid4().hex[:6]}"

    def actuate() -> subprocess.Popen[str]:
        argv = [
            *(sys.executable, "-c", "from c4stream.cli import main; main()", "actuate"),
            *("--bootstrap", kafka_bootstrap, "--backend", "command", "--execute"),
            *("--command-template", tmpl, "--ledger", str(tmp_path / "l.sqlite3")),
            *("--group", group, "--isolations-topic", topics["isolations"]),
            *("--deadletter-topic", topics["deadletter"]),
        ]
        env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP"}
        return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)

    def wait_actions(n: int, proc: subprocess.Popen[str], timeout_s: float) -> float:
        t0 = time.monotonic()
        while len(actions(out)) < n and time.monotonic() - t0 < timeout_s:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        return time.monotonic() - t0

    produce(kafka_bootstrap, topics["isolations"], [encode_command(command(id="k1"))])
    first = actuate()
    try:
        wait_actions(1, first, 40)
        assert len(actions(out)) == 1
        # Killed once k1 is committed (a kill between acting and recording would repeat
        # k1, by design: actions are safe repeats).
        probe = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            (tp,) = probe.committed([TopicPartition(topics["isolations"], 0)], timeout=10)
            if tp.offset == 1:
                break
            time.sleep(0.1)
        probe.close()
        assert tp.offset == 1
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    second = actuate()
    try:
        t0 = time.monotonic()
        # another fault (the same fault again would be a duplicate, whatever its id)
        k2 = command(id="k2", host="node002")
        produce(kafka_bootstrap, topics["isolations"], [encode_command(k2)])
        wait_actions(2, second, 40)
        resumed = time.monotonic() - t0
    finally:
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=20)
    print(f"\nactuator resumed {resumed:.1f}s after a SIGKILL restart")
    assert [a[2] for a in actions(out)] == ["k1", "k2"], err[-3000:]
    assert resumed < 15, err[-3000:]
