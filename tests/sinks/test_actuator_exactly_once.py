"""Exactly-once effects of the actuator across a SIGKILL between acting and recording.

Issue 25's probe killed the actuator right after its command backend ran and before the
ledger recorded it: on restart, 6 of 6 actions ran again. Here the same kill is real —
the actuator process SIGKILLs itself at that point through its test hook
(``C4STREAM_TEST_KILL_BEFORE_RECORD=1``, off by default) — against the real broker, with
the command backend (a script that logs every run) and with the Slurm backend against a
real slurmctld (``tests/slurm_fixture.py``; ``scontrol`` behind a prefix that logs every
call). The actuator is started again after each kill until it exits on its own.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer

from sinks.actuator.command_backend import CommandBackend
from sinks.actuator.config import ActuatorConfig, CommandSettings
from sinks.actuator.consumer import TEST_KILL_ENV, Actuator
from sinks.actuator.ledger import Ledger
from streams.commands import IsolationCommand, encode_command
from tests.slurm_fixture import SlurmCluster

# One line per run: [command id, C4STREAM_RECOVERY, argv...]; with a second file, an
# "effect" is written only for an id not seen before (a script that deduplicates).
RECORDER = """\
import json, os, sys
cid = os.environ["C4STREAM_COMMAND_ID"]
with open(sys.argv[1], "a") as f:
    f.write(json.dumps([cid, os.environ.get("C4STREAM_RECOVERY"), *sys.argv[3:]]) + "\\n")
seen = set(open(sys.argv[2]).read().split()) if os.path.exists(sys.argv[2]) else set()
if cid not in seen:
    with open(sys.argv[2], "a") as f:
        f.write(cid + "\\n")
"""

# Logs the argv, then runs it: put before scontrol as [actuator.slurm] command_prefix.
LOGGING_PREFIX = """\
import json, os, sys
with open(os.environ["C4_CALLS"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
os.execvp(sys.argv[1], sys.argv[1:])
"""


def command(i: int, host: str | None = None, **kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id=f"c4-x{i}",
        ts_us=1,
        job=f"job-{i}",
        host=host or f"node{i:03d}",
        fault="straggler",
        action="cordon",
        confidence=0.9,
        reason=f"GPU {i} arrives last",
        evidence={},
        dry_run=False,
    )
    base.update(kw)
    return IsolationCommand(**base)


def produce(bootstrap: str, topic: str, cmds: list[IsolationCommand]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for c in cmds:
        p.produce(topic, encode_command(c), key=c.host.encode())
    assert p.flush(30) == 0


def lines(path: Path) -> list[Any]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def actions_published(
    bootstrap: str, topic: str, n: int, status: str | None = None
) -> list[dict[str, Any]]:
    """Reports read from ``topic`` until ``n`` of them (of ``status``, if given) are in."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "earliest",
        }
    )
    c.subscribe([topic])
    out: list[dict[str, Any]] = []
    try:
        for _ in range(60):
            for m in c.consume(50, 0.5):
                if m.error() is None:
                    out.append(json.loads(m.value()))
            if sum(status is None or r.get("status") == status for r in out) >= n:
                break
    finally:
        c.close()
    return out


def config(
    tmp_path: Path, bootstrap: str, topics: dict[str, str], backend: str, extra: str
) -> Path:
    path = tmp_path / "c4stream.toml"
    path.write_text(
        f'[kafka]\nbootstrap = "{bootstrap}"\n'
        "[actuator]\n"
        f'backend = "{backend}"\n'
        "execute = true\n"
        f'isolations = "{topics["isolations"]}"\n'
        f'deadletter = "{topics["deadletter"]}"\n'
        f'actions = "{topics["actions"]}"\n'
        f'group = "g-{uuid.uuid4().hex[:8]}"\n'
        "exit_when_idle_s = 3.0\n"
        "max_actions_per_job_per_hour = 100\n"
        f'ledger_path = "{tmp_path / "ledger.sqlite3"}"\n' + extra
    )
    return path


def run_until_done(cfg: Path, env: dict[str, str], max_runs: int) -> tuple[int, str]:
    """Start the actuator (test hook on) again after every SIGKILL; (kills, last stderr)."""
    kills = 0
    for _ in range(max_runs):
        res = subprocess.run(
            [sys.executable, "-m", "c4stream", "actuate", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=90,
            env={**os.environ, **env, TEST_KILL_ENV: "1"},
            check=False,
        )
        if res.returncode == -9:
            kills += 1
            continue
        assert res.returncode == 0, res.stderr[-3000:]
        return kills, res.stderr
    raise AssertionError(f"still being killed after {max_runs} runs")


def recorder(tmp_path: Path) -> tuple[str, Path, Path]:
    script = tmp_path / "recorder.py"
    script.write_text(RECORDER)
    runs, effects = tmp_path / "runs.jsonl", tmp_path / "effects.txt"
    argv = (sys.executable, script, runs, effects)
    return " ".join(shlex.quote(str(a)) for a in argv) + " drain {host}", runs, effects


# ---------------------------------------------------------------- without Kafka


def test_an_unfinished_record_is_resolved_never_repeated_blindly(tmp_path: Path) -> None:
    tmpl, runs, effects = recorder(tmp_path)
    cmd = command(1)
    with Ledger(tmp_path / "l.sqlite3") as led:
        # What a kill between acting and recording leaves behind: in_progress.
        led.begin(cmd.id, host=cmd.host, action=cmd.action, detail="acting")
        assert [e.id for e in led.unfinished()] == [cmd.id]
        plain = CommandBackend(CommandSettings(template=tmpl))
        h = Actuator(ActuatorConfig(execute=True), plain, led).handle(cmd)
        assert h.status == "unknown" and "not run again" in h.detail
        assert lines(runs) == []  # not run: the script cannot be asked
        # unknown is final: a later delivery does not run it either
        again = Actuator(ActuatorConfig(execute=True), plain, led).handle(cmd)
        assert again.status == "unknown" and lines(runs) == []
        assert led.get(cmd.id).status == "unknown"  # type: ignore[union-attr]
        # The operator declares the script idempotent: a re-run carries the same id.
        other = command(2)
        led.begin(other.id, host=other.host, action=other.action, detail="acting")
        idem = CommandBackend(CommandSettings(template=tmpl, idempotent=True))
        h = Actuator(ActuatorConfig(execute=True), idem, led).handle(other)
        assert h.status == "done"
        assert lines(runs) == [["c4-x2", "1", "drain", "node002"]]
        # A first delivery runs with C4STREAM_RECOVERY=0.
        h = Actuator(ActuatorConfig(execute=True), idem, led).handle(command(3))
        assert lines(runs)[-1] == ["c4-x3", "0", "drain", "node003"]
        assert led.get("c4-x3").deliveries == 1  # type: ignore[union-attr]


def test_kubernetes_checks_the_node_after_a_crash(tmp_path: Path) -> None:
    """Against the loopback API server of test_actuator_kubernetes: a node already
    cordoned with our taint is recorded done with one GET and no write; one that is
    not (the crash came before the patch) is acted on."""
    from tests.sinks.test_actuator_kubernetes import FakeKubeAPI, backend_for, serve

    fake = FakeKubeAPI()
    with serve(fake) as url, Ledger(tmp_path / "l.sqlite3") as led:
        fake.add_node("gpu-node-3")
        fake.add_node("gpu-node-4")
        be = backend_for(url)
        done, fresh = command(3, host="gpu-node-3"), command(4, host="gpu-node-4")
        be.apply(done)  # acted, then "killed" before the ledger recorded it
        for c in (done, fresh):
            led.begin(c.id, host=c.host, action=c.action, detail="acting")
        writes = len(fake.writes())
        h = Actuator(ActuatorConfig(execute=True), be, led).handle(done)
        assert h.status == "done" and "found already applied" in h.detail
        assert len(fake.writes()) == writes  # not cordoned, tainted or evented again
        h = Actuator(ActuatorConfig(execute=True), be, led).handle(fresh)
        assert h.status == "done" and len(fake.writes()) > writes
        assert fake.nodes["gpu-node-4"]["spec"]["unschedulable"] is True


# ---------------------------------------------------------------- real kill, real broker


@pytest.mark.kafka
@pytest.mark.timeout(240)
@pytest.mark.parametrize("idempotent", [False, True])
def test_sigkill_after_the_command_ran_repeats_nothing(
    idempotent: bool,
    kafka_bootstrap: str,
    make_topics: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    n = 6 if not idempotent else 3
    topics = make_topics({"isolations": 1, "deadletter": 1, "actions": 1})
    tmpl, runs, effects = recorder(tmp_path)
    cmds = [command(i) for i in range(1, n + 1)]
    produce(kafka_bootstrap, topics["isolations"], cmds)
    extra = f"[actuator.command]\ntemplate = {json.dumps(tmpl)}\n"
    extra += f"idempotent = {str(idempotent).lower()}\n"
    cfg = config(tmp_path, kafka_bootstrap, topics, "command", extra)

    kills, stderr = run_until_done(cfg, {}, max_runs=n + 3)

    assert kills == n, stderr[-3000:]  # every command was killed in the window once
    ids = [c.id for c in cmds]
    # The effect happened exactly once per command.
    assert sorted(effects.read_text().split()) == sorted(ids)
    ran = lines(runs)
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        status = {e.id: e.status for e in led.entries()}
    if idempotent:
        # run again, with the same id and C4STREAM_RECOVERY=1; the script deduplicated
        assert sorted(r[:2] for r in ran) == sorted(
            [[i, "0"] for i in ids] + [[i, "1"] for i in ids]
        )
        assert status == dict.fromkeys(ids, "done")
    else:
        assert sorted(r[0] for r in ran) == sorted(ids)  # 0 repeated
        assert status == dict.fromkeys(ids, "unknown")
        reports = actions_published(kafka_bootstrap, topics["actions"], n, "unknown")
        assert sorted(r["command_id"] for r in reports if r["status"] == "unknown") == sorted(ids)
    effected = len(effects.read_text().split())
    print(f"\ncommand backend, idempotent={idempotent}: {n} commands, {kills} SIGKILLs between "
          f"acting and recording, {len(ran)} runs, {effected} effects")  # fmt: skip


@pytest.mark.kafka
@pytest.mark.timeout(240)
def test_sigkill_after_the_drain_repeats_no_drain_on_real_slurm(
    slurm_cluster: SlurmCluster,
    kafka_bootstrap: str,
    make_topics: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    c = slurm_cluster
    topics = make_topics({"isolations": 1, "deadletter": 1, "actions": 1})
    nodes = ["node-002", "node-003", "node-004"]
    cmds = [command(i, host=f"{node}.cluster.local") for i, node in enumerate(nodes, 1)]
    produce(kafka_bootstrap, topics["isolations"], cmds)
    prefix = tmp_path / "log-prefix.py"
    prefix.write_text(LOGGING_PREFIX)
    calls = tmp_path / "calls.jsonl"
    extra = (
        "strip_domain = true\n[actuator.slurm]\n"
        f'slurm_conf = "{c.conf}"\n'
        f"command_prefix = [{json.dumps(sys.executable)}, {json.dumps(str(prefix))}]\n"
    )
    cfg = config(tmp_path, kafka_bootstrap, topics, "slurm", extra)

    kills, stderr = run_until_done(cfg, {"C4_CALLS": str(calls)}, max_runs=len(nodes) + 3)

    assert kills == len(nodes), stderr[-3000:]
    drains = [a for a in lines(calls) if "update" in a]
    for cmd, node in zip(cmds, nodes, strict=True):
        assert [a for a in drains if f"nodename={node}" in a] != []
        assert len([a for a in drains if f"nodename={node}" in a]) == 1, drains  # 0 repeated
        n = c.node(node)
        assert "DRAIN" in n["State"] and n["Reason"].startswith(f"c4stream {cmd.id}:")
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        entries = {e.id: e for e in led.entries()}
    assert {i: e.status for i, e in entries.items()} == dict.fromkeys([x.id for x in cmds], "done")
    assert all("found already applied after a crash" in e.detail for e in entries.values())
    assert stderr.count("RECOVERED") == 1  # the last run resolved the last one
    print(f"\nslurm: {len(nodes)} drains, {kills} SIGKILLs between drain and record, "
          f"{len(drains)} scontrol update calls")  # fmt: skip


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_a_report_is_on_the_broker_before_its_command_is_done(
    kafka_bootstrap: str, make_topics: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    """The next command may be the one during which the actuator is killed: the report
    of the one before must be on ``c4.actions`` already, and its command not committed
    before that (a report still queued in the producer was lost to a SIGKILL once)."""
    from c4base.metrics import NullMetrics
    from c4base.progress import Progress
    from c4base.runtime import Record
    from sinks.actuator.consumer import ActuatorHandler, RunStats
    from sinks.actuator.outcomes import OutcomePublisher

    topics = make_topics({"actions": 1})
    tmpl, _, _ = recorder(tmp_path)
    progress = Progress()

    class Ctx:
        def hold(self, rec: Record) -> Any:
            return progress.hold(rec)

        def dead_letter(self, rec: Record, reason: str) -> None:
            raise AssertionError(reason)

    slow = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 30_000})
    cfg = ActuatorConfig(execute=True, attempts=1)
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        actuator = Actuator(cfg, CommandBackend(CommandSettings(template=tmpl)), led)
        handler = ActuatorHandler(
            actuator, RunStats(), NullMetrics(), OutcomePublisher(slow, topics["actions"])
        )
        rec = Record("c4.isolations", 0, 7, b"node001", encode_command(command(1)))
        handler.handle(rec, Ctx())
        progress.handled(rec)
        assert progress.committable({}) == {("c4.isolations", 0): 8}  # delivered: no hold
        # read back within 3 s (the linger is 30 s), the actuator's producer left open
        c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": uuid.uuid4().hex,
                      "auto.offset.reset": "earliest"})  # fmt: skip
        c.subscribe([topics["actions"]])
        reports = [json.loads(m.value()) for m in c.consume(10, 3.0) if m.error() is None]
        c.close()
    assert [(r["command_id"], r["status"]) for r in reports] == [("c4-x1", "done")]
