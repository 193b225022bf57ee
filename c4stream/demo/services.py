"""Start c4stream services as child processes and stop them all, whatever happens.

Each child runs in its own process group, so stopping it also stops anything it
started; stop is SIGTERM, a grace period, then SIGKILL. Used by the demo, and by tests
that need a service running beside them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["Service", "ServiceGroup"]


@dataclass
class Service:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class ServiceGroup:
    """A set of child services with one clean stop (also on Ctrl-C and on errors)."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    services: list[Service] = field(default_factory=list)

    def start(self, name: str, *args: str) -> Service:
        """Start ``c4stream ARGS…`` with this interpreter, logging to ``log_dir/name.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        svc = Service(name, [sys.executable, "-m", "c4stream", *args], self.log_dir / f"{name}.log")
        log = open(svc.log_path, "wb")  # noqa: SIM115 - the child owns it until it exits
        svc.proc = subprocess.Popen(
            svc.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        self.services.append(svc)
        return svc

    def check(self) -> None:
        """Raise if a service died on its own; the message carries its log's tail."""
        for svc in self.services:
            if svc.proc is not None and svc.proc.poll() is not None:
                raise RuntimeError(
                    f"service {svc.name} exited with status {svc.proc.returncode}; "
                    f"last lines of {svc.log_path}:\n{svc.log_tail()}"
                )

    def stop(self, grace_s: float = 15.0) -> None:
        for svc in reversed(self.services):
            if svc.alive():
                assert svc.proc is not None
                try:
                    os.killpg(svc.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for svc in reversed(self.services):
            if svc.proc is None:
                continue
            try:
                svc.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The group may hold grandchildren even when the leader has exited.
            try:
                os.killpg(svc.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            svc.proc.wait()

    def __enter__(self) -> ServiceGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
