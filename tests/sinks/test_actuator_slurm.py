"""The actuator against a real Slurm (tests/slurm_fixture.py): scontrol, slurmctld, munge.

Defects of issue 13 covered here: every scontrol failure was retried as transient
(a non-admin user or a missing slurm.conf lost every isolation while the service ran on
with status 0; an unknown node was retried); a drain replaced an administrator's reason;
a fully qualified host name did not map to the node name; a ``restart_job`` without a
template was recorded as done.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from sinks.actuator.backends import ActuatorConfigError, PermanentActionError
from sinks.actuator.command_backend import CommandBackend
from sinks.actuator.config import ActuatorConfig, CommandSettings, SlurmSettings
from sinks.actuator.consumer import Actuator
from sinks.actuator.ledger import Ledger
from sinks.actuator.slurm_backend import SlurmBackend
from streams.commands import IsolationCommand, encode_command
from tests.kafka_helpers import consume
from tests.slurm_fixture import SlurmCluster, as_user_prefix, runuser_available

pytestmark = pytest.mark.timeout(120)

needs_runuser = pytest.mark.skipif(not runuser_available(), reason="needs root and runuser")


def command(**kw: Any) -> IsolationCommand:
    base: dict[str, Any] = dict(
        id="c4-7",
        ts_us=1,
        job="llm",
        host="node-002",
        gpu=5,
        fault="straggler",
        action="cordon",
        confidence=0.93,
        reason="node-002 GPU 5 arrived last in 40 of 40 all-reduces.",
        evidence={},
        dry_run=False,  # absent means dry run
    )
    base.update(kw)
    return IsolationCommand(**base)


def backend(c: SlurmCluster, **kw: Any) -> SlurmBackend:
    return SlurmBackend(SlurmSettings(slurm_conf=str(c.conf), **kw))


def flags(c: SlurmCluster, name: str) -> set[str]:
    return set(c.node(name)["State"].rstrip("*").split("+"))


def test_drains_exactly_the_mapped_node_with_a_recognisable_reason(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    c = slurm_cluster
    before = {n: c.node(n)["State"] for n in c.nodes}
    cfg = ActuatorConfig(execute=True, backend="slurm", strip_domain=True)
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        act = Actuator(cfg, backend(c), led)
        h = act.handle(command(host="node-002.cluster.local"))
        assert (h.decision, h.status, h.node) == ("act", "done", "node-002")
        n2 = c.node("node-002")
        assert "DRAIN" in flags(c, "node-002")
        assert n2["Reason"].startswith("c4stream c4-7: node-002 GPU 5 arrived last")
        for other in set(c.nodes) - {"node-002"}:
            assert c.node(other)["State"] == before[other], other
        # A repeat (another command for the same node) leaves c4stream's reason alone.
        again = act.handle(
            command(id="c4-8", gpu=6)
        )  # another fault: the same fault is a duplicate
        assert again.status == "done" and "already drained by c4stream" in again.detail
        assert c.node("node-002")["Reason"] == n2["Reason"]


def test_an_administrators_drain_is_kept_and_reported(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    c = slurm_cluster
    c.drain("node-003", "RMA ticket 1234")
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        h = Actuator(ActuatorConfig(execute=True), backend(c), led).handle(command(host="node-003"))
        assert (h.decision, h.status) == ("act", "skipped")
        assert "RMA ticket 1234" in h.detail and "left as it is" in h.detail
        assert led.get("c4-7").status == "skipped"  # type: ignore[union-attr]
        assert not led.is_done("c4-7")
    assert c.node("node-003")["Reason"].startswith("RMA ticket 1234")


def test_an_unknown_node_fails_at_once_without_retries(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    c = slurm_cluster
    with pytest.raises(PermanentActionError, match="node-999"):
        backend(c).apply(command(host="node-999"))
    cfg = ActuatorConfig(execute=True, attempts=3, retry_backoff_s=30.0)
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        t0 = time.monotonic()
        h = Actuator(cfg, backend(c), led).handle(command(host="node-999"))
        assert time.monotonic() - t0 < 20  # a retry would have waited 30 s first
    assert h.status == "failed" and "gave up" not in h.detail
    assert h.deadletter_reason is not None and "not found" in h.deadletter_reason


@needs_runuser
def test_a_non_admin_scontrol_is_fatal_in_both_backends(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = slurm_cluster
    nobody = backend(c, command_prefix=tuple(as_user_prefix("nobody")))
    with pytest.raises(ActuatorConfigError, match="Invalid user id"):
        nobody.apply(command())
    # The setup: the command backend with an scontrol template.
    monkeypatch.setenv("SLURM_CONF", str(c.conf))
    tmpl = "runuser -u nobody -- scontrol update nodename={host} state=drain reason={reason}"
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        act = Actuator(
            ActuatorConfig(execute=True), CommandBackend(CommandSettings(template=tmpl)), led
        )
        with pytest.raises(ActuatorConfigError, match="Invalid user id"):
            act.handle(command())
        # Recorded failed, which blocks nothing: delivered again after the fix, it acts.
        e = led.get("c4-7")
        assert e is not None and e.status == "failed" and not led.is_done("c4-7")
    assert "DRAIN" not in flags(c, "node-002")


def test_a_missing_slurm_conf_is_fatal(
    slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ActuatorConfigError, match="does not exist"):
        SlurmBackend(SlurmSettings(slurm_conf=str(tmp_path / "slurm.conf")))
    # scontrol itself retries a missing file for 60 s; what it printed before the
    # timeout killed it is enough to tell.
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "nope.conf"))
    be = CommandBackend(
        CommandSettings(
            template="scontrol update nodename={host} state=drain reason={reason}", timeout_s=3
        )
    )
    with pytest.raises(ActuatorConfigError, match="cannot stat file"):
        be.apply(command())


def test_check_pings_shows_a_node_and_names_the_user(slurm_cluster: SlurmCluster) -> None:
    c = slurm_cluster
    lines = backend(c, check_node="node-003").check()
    assert lines[0].startswith("slurm: Slurmctld(primary) at") and lines[0].endswith("is UP")
    assert lines[1].startswith("slurm: node node-003: State=")
    assert "may drain" in lines[2]
    with pytest.raises(ActuatorConfigError, match="node-999"):
        backend(c, check_node="node-999").check()
    if runuser_available():
        warn = backend(c, command_prefix=tuple(as_user_prefix("nobody"))).check()
        assert "WARNING: scontrol runs as nobody" in warn[-1]


def test_restart_job_without_a_template_is_skipped_not_done(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    c = slurm_cluster
    cmd = command(action="restart_job")
    cmd_be = CommandBackend(
        CommandSettings(template="scontrol update nodename={host} state=drain reason={reason}")
    )
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        for be in (cmd_be, backend(c)):
            h = Actuator(ActuatorConfig(execute=True), be, led).handle(cmd)
            assert h.status == "skipped", be.name
            assert not led.is_done(cmd.id)
    assert "DRAIN" not in flags(c, "node-002")


def _write_config(
    path: Path, c: SlurmCluster, bootstrap: str, topics: dict[str, str], **kw: str
) -> None:
    extra = "".join(f"{k} = {v}\n" for k, v in kw.items())
    path.write_text(
        f'[kafka]\nbootstrap = "{bootstrap}"\n'
        "[actuator]\n"
        'backend = "slurm"\n'
        "execute = true\n"
        "strip_domain = true\n"
        f'isolations = "{topics["isolations"]}"\n'
        f'deadletter = "{topics["deadletter"]}"\n'
        f'actions = "{topics["actions"]}"\n'
        f'group = "g-{uuid.uuid4().hex[:8]}"\n'
        "exit_when_idle_s = 4.0\n"
        f'ledger_path = "{path.parent / "ledger.sqlite3"}"\n'
        "[actuator.slurm]\n"
        f'slurm_conf = "{c.conf}"\n' + extra
    )


def _actuate(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "c4stream", "actuate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        check=False,
    )


@pytest.mark.kafka
@needs_runuser
def test_the_service_stops_non_zero_as_a_non_admin_and_acts_after_the_fix(
    slurm_cluster: SlurmCluster, kafka_bootstrap: str, make_topics: Any, tmp_path: Path
) -> None:
    from confluent_kafka import Producer

    c = slurm_cluster
    topics = make_topics({"isolations": 1, "deadletter": 1, "actions": 1})
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(topics["isolations"], encode_command(command(host="node-002.cluster.local")))
    assert p.flush(30) == 0
    config = tmp_path / "c4stream.toml"
    prefix = ", ".join(f'"{a}"' for a in as_user_prefix("nobody"))
    _write_config(config, c, kafka_bootstrap, topics, command_prefix=f"[{prefix}]")
    res = _actuate(config)
    assert res.returncode == 2, res.stderr
    assert "stopped" in res.stderr and "Invalid user id" in res.stderr
    assert "DRAIN" not in flags(c, "node-002")
    # The operator fixes the user; the same command is delivered again and acts.
    _write_config(config, c, kafka_bootstrap, topics)
    res = _actuate(config)
    assert res.returncode == 0, res.stderr
    assert "DRAIN" in flags(c, "node-002")
    assert c.node("node-002")["Reason"].startswith("c4stream c4-7:")
    [msg] = consume(kafka_bootstrap, topics["actions"], expect=1)
    assert b'"status":"done"' in msg.value() and b'"node":"node-002"' in msg.value()


def test_actuate_check_on_the_command_line(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "c4stream", "actuate", "--backend", "slurm",
         "--slurm-conf", str(slurm_cluster.conf), "--check"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "is UP" in ok.stdout and "backend slurm ok" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "c4stream", "actuate", "--backend", "slurm",
         "--slurm-conf", str(tmp_path / "missing.conf"), "--check"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "FAILED" in bad.stderr and "does not exist" in bad.stderr
