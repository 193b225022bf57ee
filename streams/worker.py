"""Run the c4stream Faust worker: in this process (blocking) or as a child process.

``c4stream worker`` calls :func:`run_worker`; the demo and the tests use
:func:`start_worker_process`, which returns a handle to wait for readiness (through the
worker's ``status.json``) and to stop it cleanly with SIGTERM.

The worker runs until SIGINT or SIGTERM; on either it stops consuming, checkpoints
every detector and the correlator to their tables, flushes the producer and exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from c4base import lifeguard
from c4base.kafka import KafkaCredentialsError
from c4base.lifeguard import write_status
from c4base.metrics import Metrics, MetricsConfig
from streams.app.faust_app import make_app
from streams.app.settings import WorkerConfig
from streams.app.topics_admin import ensure_topics

__all__ = ["WorkerProcess", "WorkerStartError", "run_worker", "start_worker_process"]

log = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    """The worker did not become ready in time; its log (named in the message) says why."""


def run_worker(
    config: WorkerConfig, engine: Any = None, metrics: Any = None, *, own_logging: bool = False
) -> int:
    """Create the topics, build the app and run it until SIGINT/SIGTERM; returns the exit code.

    ``metrics`` (:class:`c4base.metrics.Metrics`, served by the caller) gets the counters.
    ``own_logging``: the caller has set up logging (``c4base.service``); Faust then
    leaves the root logger alone instead of installing its own handlers at
    ``config.loglevel``.
    """
    from streams.app.faust_adapter import BoundedStopWorker

    ensure_topics(config)
    # A fresh loop per run: Faust binds its services to the loop current at creation.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    app = make_app(config, engine, metrics)
    parts = app.c4_parts
    status_path = config.status_path()

    def broker_changed(since_monotonic: float | None) -> None:
        parts.broker_down_since = None if since_monotonic is None else time.time()
        write_status(status_path, parts.status())

    def broker_lost(seconds: float) -> None:
        parts.ready = False
        write_status(status_path, {**parts.status(), "exit": "broker unreachable"})
        lifeguard.exit_broker_lost(seconds)

    watch = lifeguard.BrokerWatch(
        lifeguard.kafka_probe(config.kafka.client_config()),
        exit_after_s=config.broker_unreachable_exit_s,
        every_s=min(2.0, config.broker_unreachable_exit_s / 3),
        on_change=broker_changed,
        on_lost=broker_lost,
    )

    worker = BoundedStopWorker(
        app,
        grace_s=config.stop_grace_s,
        on_overdue=lambda: write_status(status_path, {**parts.status(), "ready": False}),
        own_logging=own_logging,
        loglevel=config.loglevel,
        quiet=True,
        redirect_stdouts=False,
        workdir=config.workdir,
        loop=loop,
    )
    worker.spinner = None  # no terminal spinner escapes in log files
    watch.start()
    try:
        worker.execute_from_commandline()
    except SystemExit as done:
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        watch.stop()
    return 0


class WorkerProcess:
    """A worker running as a child process (``python -m streams.worker CONFIG.json``)."""

    def __init__(self, proc: subprocess.Popen[bytes], config: WorkerConfig, log_path: Path):
        self.proc = proc
        self.config = config
        self.log_path = log_path

    def status(self) -> dict[str, Any]:
        """The worker's last ``status.json`` (empty before it wrote one)."""
        try:
            status = json.loads(self.config.status_path().read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return status if status.get("pid") == self.proc.pid else {}

    def wait_for(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        """Poll the status until ``predicate(status)`` holds; raise with the log tail if not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise WorkerStartError(
                    f"worker exited with {self.proc.returncode} while waiting for {what}; "
                    f"see {self.log_path}:\n{self.log_tail()}"
                )
            st = self.status()
            if st and predicate(st):
                return st
            time.sleep(0.1)
        raise WorkerStartError(
            f"worker not {what} after {timeout:.0f}s; see {self.log_path}:\n{self.log_tail()}"
        )

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Until the worker has joined its group, restored its tables and got partitions."""
        return self.wait_for(lambda s: s.get("ready") and s.get("assigned"), timeout, "ready")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait for a clean stop (SIGKILL after ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop in %.0fs; killing it", self.proc.pid, timeout)
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_worker_process(
    config: WorkerConfig, *, env: dict[str, str] | None = None, metrics_port: int = 0
) -> WorkerProcess:
    """Start ``run_worker(config)`` in a child process logging to ``workdir/worker.log``;
    ``metrics_port`` > 0 serves its Prometheus /metrics on 127.0.0.1 at that port."""
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / "worker-config.json"
    cfg_path.write_bytes(msgspec.json.encode(config))
    log_path = workdir / "worker.log"
    root = str(Path(__file__).resolve().parent.parent)
    child_env = {**os.environ, **(env or {})}
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "streams.worker", str(cfg_path), str(metrics_port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=root,
        )
    return WorkerProcess(proc, config, log_path)


def _main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m streams.worker CONFIG.json [METRICS_PORT]", file=sys.stderr)
        return 2
    config = msgspec.json.decode(Path(argv[0]).read_bytes(), type=WorkerConfig)
    port = int(argv[1]) if len(argv) == 2 else 0
    metrics = Metrics() if port else None
    if metrics is not None:
        metrics.serve(MetricsConfig(port=port))
    try:
        return run_worker(config, metrics=metrics)
    except KafkaCredentialsError as err:  # refused before the broker watch runs
        print(f"worker: {err}", file=sys.stderr)
        return lifeguard.EXIT_CREDENTIALS_REFUSED


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
