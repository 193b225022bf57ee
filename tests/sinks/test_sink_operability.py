"""Issue 12 item 7 for the three sinks, through their real CLIs: with no broker they
exit non-zero after ``--broker-timeout``, answer SIGTERM within seconds while the broker
is away, rate-limit the repeated error lines, and their status file says not ready.

No broker is needed: the bootstrap address is a loopback port nobody listens on.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ARGV = [sys.executable, "-c", "from c4stream.cli import main; main()"]


def _dead_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _command(sink: str, tmp_path: Path) -> list[str]:
    if sink == "actuate":
        return [
            "actuate",
            "--backend",
            "command",
            "--command-template",
            "true {host}",
            "--ledger",
            str(tmp_path / "ledger.db"),
        ]
    if sink == "archive":
        return ["archive", "--out", str(tmp_path / "archive")]
    toml = tmp_path / "alert.toml"
    toml.write_text('[[destination]]\ntype = "slack"\nurl = "http://127.0.0.1:9/x"\n')
    return ["alert", "--config", str(toml)]


def _start(sink: str, tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path]:
    status = tmp_path / "status.json"
    argv = [*ARGV, *_command(sink, tmp_path), "--bootstrap", _dead_port()]
    argv += ["--status-file", str(status), "--instance-id", "", *extra]
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP"}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc, status


SINKS = ["actuate", "archive", "alert"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sink", SINKS)
def test_broker_gone_exits_non_zero_after_the_timeout(sink: str, tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc, status = _start(sink, tmp_path, "--broker-timeout", "4")
    out, _ = proc.communicate(timeout=40)
    took = time.monotonic() - t0
    print(f"\n{sink}: exit {proc.returncode} after {took:.1f}s, {len(out.splitlines())} lines")
    assert proc.returncode == 1, out[-3000:]
    assert f"c4stream {sink}: error: " in out and "Kafka broker" in out and "unreachable" in out
    assert 4 <= took < 30
    state = json.loads(status.read_text())
    assert state["ready"] is False and state["state"] == "failed"
    # The same connection error over and over is logged a few times, not a flood.
    assert len(out.splitlines()) < 40, out[-3000:]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sink", SINKS)
def test_sigterm_is_answered_within_seconds_while_the_broker_is_away(
    sink: str, tmp_path: Path
) -> None:
    proc, status = _start(sink, tmp_path, "--broker-timeout", "0")
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if status.exists():
                state = json.loads(status.read_text())
                if state.get("broker_down_s") is not None:
                    break
            time.sleep(0.2)
        assert state["ready"] is False and state["broker_down_s"] is not None, state
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"\n{sink}: SIGTERM answered in {took:.1f}s, exit {proc.returncode}")
    assert proc.returncode == 0, out[-3000:]
    assert took < 10
