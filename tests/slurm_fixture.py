"""A real single-host Slurm for tests: munged + slurmctld (+ one slurmd), all on loopback.

``tests/conftest.py`` registers this module as a plugin, so any test takes the fixture::

    from tests.slurm_fixture import SlurmCluster

    def test_drain(slurm_cluster: SlurmCluster) -> None:
        slurm_cluster.scontrol("update", "nodename=node-002", "state=drain", "reason=x")
        assert slurm_cluster.node("node-002")["State"].startswith("IDLE+DRAIN")

What it starts (Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge``, which
``./run`` installs), in a fresh world-readable temporary directory, torn down after the test:

- ``munged`` with its own key and socket (``AuthInfo=socket=…`` points Slurm at it);
- ``slurmctld`` on a free loopback port, ``SlurmUser`` = the user running the tests;
- node names ``node-001`` … ``node-004``, every one ``NodeAddr=127.0.0.1``: slurmctld can
  drain, resume and show a node whose slurmd is not running (it is then ``…*``, not
  responding, which changes nothing for ``scontrol update``);
- one ``slurmd -N node-001`` when running as root (Debian's build runs one slurmd per
  host; ``-N`` picks the node name it serves), so ``node-001`` is ``IDLE`` and batch jobs
  run there: :meth:`SlurmCluster.sbatch` submits one, ``scontrol requeue`` works on it.

The object the fixture yields carries the ``slurm.conf`` path, the environment
(``SLURM_CONF``) to run any Slurm command with, the node names and small helpers. Tests
skip with the reason when the programs are missing (``./run`` installs them).
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["SlurmCluster", "SlurmError", "slurm_cluster", "start_slurm"]

PROGRAMS = ("munged", "slurmctld", "slurmd", "scontrol", "sbatch", "squeue", "scancel")
NODES = ("node-001", "node-002", "node-003", "node-004")
_START_TIMEOUT_S = 30.0


class SlurmError(RuntimeError):
    """The test cluster could not start; the message holds the daemons' log tails."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_show(text: str) -> dict[str, str]:
    """``scontrol -o show node X`` (one line of ``Key=Value`` pairs) as a dict.

    Values may hold spaces (``Reason=RMA ticket 1234 [root@…]`` is last on the line),
    so a value runs up to the next `` Key=``.

    >>> d = parse_show("NodeName=n1 State=IDLE+DRAIN Reason=RMA ticket 1 [root@2026-01-01]")
    >>> d["State"], d["Reason"]
    ('IDLE+DRAIN', 'RMA ticket 1 [root@2026-01-01]')
    """
    out: dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z_]+)=(.*?)(?=\s+[A-Za-z_]+=|\s*$)", text.strip()):
        out[m.group(1)] = m.group(2).strip()
    return out


@dataclass
class SlurmCluster:
    """A running test cluster (see the module docstring)."""

    root: Path
    """Temporary directory with slurm.conf, state, logs and the munge socket."""
    conf: Path
    """The slurm.conf; also in :attr:`env` as ``SLURM_CONF``."""
    env: dict[str, str]
    """``os.environ`` plus ``SLURM_CONF``: pass as ``env=`` to run any Slurm command."""
    nodes: tuple[str, ...]
    """Every node name slurmctld knows (all on 127.0.0.1)."""
    compute_node: str | None
    """The node a slurmd serves (jobs run there); None when not running as root."""
    admin: str
    """The SlurmUser (an administrator of this cluster): the user running the tests."""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(
        self, *argv: str, user: str | None = None, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command with this cluster's env; ``user`` runs it via ``runuser``."""
        cmd = list(argv)
        if user is not None:
            cmd = ["runuser", "-u", user, "--", "env", f"SLURM_CONF={self.conf}", *cmd]
        proc = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("scontrol", *args, check=check)

    def node(self, name: str) -> dict[str, str]:
        """The node's fields as slurmctld reports them (``State``, ``Reason``, …)."""
        return parse_show(self.scontrol("-o", "show", "node", name).stdout)

    def drain(self, name: str, reason: str) -> None:
        """Drain ``name`` as the administrator would."""
        self.scontrol("update", f"nodename={name}", "state=drain", f"reason={reason}")

    def sbatch(self, script: str = "sleep 300", *args: str) -> str:
        """Submit ``--wrap script`` to :attr:`compute_node` (plus ``args``); the job id."""
        if self.compute_node is None:
            pytest.skip("no slurmd here (needs root): batch jobs cannot run")
        out = self.run(
            "sbatch",
            "--parsable",
            "-w",
            self.compute_node,
            "-o",
            str(self.root / "job-%j.out"),
            *args,
            "--wrap",
            script,
        ).stdout
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol -o show job`` as a dict (``JobState``, ``Restarts``, …)."""
        return parse_show(self.scontrol("-o", "show", "job", job_id).stdout)

    def wait_job_state(self, job_id: str, *states: str, timeout: float = 20.0) -> str:
        """Wait (bounded) until the job is in one of ``states``; returns the state."""
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job(job_id).get("JobState", "")
            if state in states:
                return state
            time.sleep(0.2)
        raise SlurmError(f"job {job_id} is {state}, not {states} after {timeout:g}s")

    def log_tail(self, lines: int = 30) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*.log")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel jobs, stop the daemons (newest first), remove the directory."""
        if self.procs and shutil.which("scancel"):
            subprocess.run(
                ["scancel", "--full", "--quiet", "--user", self.admin],
                env=self.env,
                capture_output=True,
                timeout=30,
                check=False,
            )
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=3)  # test daemons: their state is thrown away anyway
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def _conf_text(root: Path, ctld_port: int, slurmd_port: int, admin: str) -> str:
    host = socket.gethostname().split(".")[0]
    return "\n".join(
        [
            "ClusterName=c4test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            f"SlurmUser={admin}",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/munge.sock",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            "MailProg=/bin/true",
            # No cgroups in a test container: plain process tracking, no task binding.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=300",
            f"NodeName={','.join(NODES)} NodeAddr=127.0.0.1 CPUs=1 RealMemory=100 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _wait(what: str, ok: Callable[[], bool], cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in cluster.procs:
            if p.poll() is not None:
                raise SlurmError(f"{p.args[0]} exited {p.returncode}\n{cluster.log_tail()}")
        if ok():
            return
        time.sleep(0.2)
    raise SlurmError(f"{what} not ready after {timeout:g}s\n{cluster.log_tail()}")


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None]


def start_slurm(with_slurmd: bool | None = None) -> SlurmCluster:
    """Start munged, slurmctld and (as root, unless told not to) one slurmd; see the module."""
    missing = missing_programs()
    if missing:
        raise SlurmError(f"not installed: {', '.join(missing)} (./run installs them)")
    is_root = os.geteuid() == 0
    with_slurmd = is_root if with_slurmd is None else with_slurmd and is_root
    admin = getpass.getuser()
    # World-readable (0755), so a non-admin user run via runuser can read slurm.conf
    # and reach the munge socket, as on a real cluster.
    root = Path(tempfile.mkdtemp(prefix="c4slurm-"))
    root.chmod(0o755)
    for d in ("munge", "state", "spool", "log"):
        (root / d).mkdir()
        (root / d).chmod(0o755)
    conf = root / "slurm.conf"
    conf.write_text(_conf_text(root, _free_port(), _free_port(), admin))
    conf.chmod(0o644)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    cluster = SlurmCluster(
        root=root,
        conf=conf,
        env=env,
        nodes=NODES,
        compute_node=NODES[0] if with_slurmd else None,
        admin=admin,
    )
    try:
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        log = (root / "log" / "daemons.out").open("ab")
        # --force: munged refuses to run as root or with a non-standard layout otherwise.
        cluster.procs.append(
            subprocess.Popen(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={root}/munge/munge.sock",
                    f"--pid-file={root}/munge/munged.pid",
                    f"--log-file={root}/log/munged.log",
                    f"--seed-file={root}/munge/seed",
                ],
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        )
        _wait("munged", (root / "munge" / "munge.sock").exists, cluster, _START_TIMEOUT_S)
        cluster.procs.append(
            subprocess.Popen(
                ["slurmctld", "-D", "-i", "-f", str(conf)],
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        )

        def ctld_up() -> bool:
            out = cluster.scontrol("ping", check=False).stdout
            return " is UP" in out

        _wait("slurmctld", ctld_up, cluster, _START_TIMEOUT_S)
        if cluster.compute_node is not None:
            (root / "spool" / cluster.compute_node).mkdir()
            cluster.procs.append(
                subprocess.Popen(
                    ["slurmd", "-D", "-N", cluster.compute_node, "-f", str(conf)],
                    env=env,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
            )
            node = cluster.compute_node

            def slurmd_up() -> bool:
                return cluster.node(node).get("State", "").startswith("IDLE")

            _wait("slurmd", slurmd_up, cluster, _START_TIMEOUT_S)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A fresh cluster per test (about 1–2 s to start); skipped if Slurm is not installed."""
    missing = missing_programs()
    if missing:
        pytest.skip(f"Slurm/munge not installed ({', '.join(missing)}); ./run installs them")
    cluster = start_slurm()
    try:
        yield cluster
    finally:
        cluster.stop()


def runuser_available() -> bool:
    """Whether tests can run a command as another user (root with runuser)."""
    return os.geteuid() == 0 and shutil.which("runuser") is not None


def as_user_prefix(user: str = "nobody") -> Sequence[str]:
    """argv prefix that runs a program as ``user`` (for a non-admin ``scontrol``)."""
    return ("runuser", "-u", user, "--")
