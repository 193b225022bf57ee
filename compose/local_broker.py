"""A no-Docker, single-node Apache Kafka (KRaft) broker for the demo and the tests.

The broker is plain Apache Kafka run from its Maven jars: ``compose/kafka/pom.xml``
lists them, ``mvn dependency:copy-dependencies`` fetches them once into a cache
directory, and every start is ``java -cp 'libs/*' kafka.Kafka server.properties``
with a fresh temp data dir. Only ``java`` (17+) and, for the first fetch, ``mvn``
are needed.

Broker settings worth knowing:

* ``auto.create.topics.enable=true``: Faust and the sinks may subscribe to or
  produce on topics (dead-letter, changelogs) before anyone created them; auto
  creation keeps that working. Anything whose partition count matters is created
  explicitly with :func:`create_topics`; auto-created topics get one partition.
* Replication factors and min ISR of all internal topics are 1 (one node), the
  group join delay is 0 and the internal topics have few partitions, so the first
  consumer group of a test joins in well under a second.
* Share groups (KIP-932) stay off; nothing here uses them.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from c4base.kafka_admin import create_topics

__all__ = [
    "KAFKA_VERSION",
    "BrokerError",
    "LocalKafka",
    "broker_for_tests",
    "cache_root",
    "create_topics",
    "ensure_broker",
    "fetch_jars",
    "libs_dir",
    "scram_arguments",
]

log = logging.getLogger(__name__)

#: Kafka version fetched and run; must match ``kafka.version`` in the pom.
KAFKA_VERSION = "4.1.1"
POM = Path(__file__).with_name("kafka") / "pom.xml"
APT_HINT = "install them with: sudo apt-get install openjdk-17-jre-headless maven"
DATA_DIR_PREFIX = "c4stream-kafka-"
_MARKER = ".fetch-complete"


class BrokerError(RuntimeError):
    """The local broker could not be fetched, started or reached."""


# --------------------------------------------------------------------------- jars


def cache_root() -> Path:
    """``$C4STREAM_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/c4stream``."""
    explicit = os.environ.get("C4STREAM_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "c4stream"


def libs_dir(version: str = KAFKA_VERSION) -> Path:
    """Where the jars of ``version`` live (``<cache root>/kafka-<version>/libs``)."""
    return cache_root() / f"kafka-{version}" / "libs"


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise BrokerError(
            f"`{tool}` not found on PATH; the local Kafka broker needs "
            f"Java 17+ and Maven, {APT_HINT}"
        )
    return path


def _java_major(java: str) -> int:
    out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30)
    # e.g. 'openjdk version "17.0.15" 2025-04-15' or 'java version "1.8.0_402"'
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not m:
        return 0
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major


def fetch_jars(version: str = KAFKA_VERSION, *, force: bool = False) -> Path:
    """Fetch Kafka's jars into the cache once and return the ``libs`` directory.

    The fetch goes to a scratch dir that is renamed into place, and a marker file is
    written only after that succeeded, so an interrupted fetch is simply redone. A
    file lock serialises concurrent callers (e.g. several pytest workers).
    """
    libs = libs_dir(version)
    home = libs.parent
    marker = home / _MARKER
    if not force and marker.is_file() and libs.is_dir():
        return libs
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not force and marker.is_file() and libs.is_dir():
            return libs  # another process finished it while we waited
        mvn = _require("mvn")
        _require("java")
        if not POM.is_file():
            raise BrokerError(f"{POM} is missing; is the c4stream package data installed?")
        marker.unlink(missing_ok=True)
        for stale in home.glob("libs-*"):  # scratch dirs of fetches that were killed
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix="libs-", dir=home))
        try:
            cmd = [
                mvn,
                "-q",
                "-B",
                "-f",
                str(POM),
                f"-Dkafka.version={version}",  # user properties override the pom's
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={scratch}",
            ]
            log.info("fetching Kafka %s jars into %s", version, libs)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0 or not any(scratch.glob(f"kafka_2.13-{version}.jar")):
                tail = (proc.stdout + proc.stderr).strip().splitlines()[-30:]
                raise BrokerError(
                    f"fetching Kafka {version} jars with Maven failed "
                    f"(exit {proc.returncode}):\n" + "\n".join(tail)
                )
            if libs.exists():
                shutil.rmtree(libs)  # leftover of a fetch that never wrote its marker
            scratch.rename(libs)
            marker.write_text(f"kafka {version}\n")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return libs


# --------------------------------------------------------------------------- broker


def _free_port() -> int:
    # Small race (someone may grab it before Kafka binds); start() retries on bind errors.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cluster_id() -> str:
    # Kafka's Uuid.toString(): url-safe base64 of 16 random bytes, unpadded. Kafka
    # itself never hands out ids starting with '-' (they break CLI parsing); nor do we.
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap_stale_data_dirs() -> None:
    """Remove data dirs of brokers whose Python owner died without cleaning up."""
    for d in Path(tempfile.gettempdir()).glob(DATA_DIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not _pid_alive(owner):
            shutil.rmtree(d, ignore_errors=True)


def _set_pdeathsig() -> None:
    # Runs in the child before exec: ask Linux to SIGKILL the broker if the parent
    # dies, so even a SIGKILLed pytest leaves no stray java behind (atexit can't
    # help there).
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # best effort, not available everywhere
        pass


_LOG4J2 = """\
status = error
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.authorizer.name = kafka.authorizer.logger
logger.authorizer.level = WARN
"""


def scram_arguments(users: Mapping[str, str]) -> list[str]:
    """``kafka-storage format`` arguments that create SCRAM-SHA-512 users.

    >>> scram_arguments({"c4-worker": "pw"})
    ['--add-scram', 'SCRAM-SHA-512=[name=c4-worker,password=pw]']
    """
    out: list[str] = []
    for name, password in users.items():
        # The tool's own syntax splits on ',', ']' and '='; quoting is not supported.
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or re.search(r"[,\]=\s]", password):
            raise BrokerError(f"SCRAM user {name!r}: name or password has a reserved character")
        out += ["--add-scram", f"SCRAM-SHA-512=[name={name},password={password}]"]
    return out


class LocalKafka:
    """One KRaft node (broker + controller) on 127.0.0.1 in a throw-away data dir.

    Use as a context manager, or call :meth:`start` / :meth:`stop`. ``bootstrap``
    is the ``host:port`` clients connect to.
    """

    # Strong refs: a started broker nobody holds on to must still be stopped at exit.
    _running: set[LocalKafka] = set()

    def __init__(
        self,
        *,
        port: int = 0,
        version: str = KAFKA_VERSION,
        heap: str = "512m",
        startup_timeout: float = 60.0,
        stop_timeout: float = 15.0,
        jvm_args: Sequence[str] = (),
        data_dir: str | Path | None = None,
        secure_listener: dict[str, str] | None = None,
        scram_users: Mapping[str, str] | None = None,
    ) -> None:
        self.version = version
        self.heap = heap
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.jvm_args = list(jvm_args)
        self._fixed_port = port  # 0 = pick a free one
        self.port = 0
        self.controller_port = 0
        self.workdir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.secure_listener = secure_listener
        """Broker properties of a second listener for the tests of TLS/SASL clients: its
        own ``port`` key, ``protocol`` (``SASL_SSL``, the default, or ``SSL``: TLS only,
        with ``ssl.client.auth=required`` for mutual TLS), and the listener's settings
        (``listener.name.sasl_ssl.*`` JAAS, ``ssl.*``). The PLAINTEXT listener on
        :attr:`bootstrap` stays (admin, readiness)."""
        self.scram_users = dict(scram_users or {})
        """SCRAM-SHA-512 users (name → password) written into the cluster's metadata when
        it is formatted (``kafka-storage format --add-scram``), as KRaft stores them: a
        SASL_SSL listener with ``sasl.enabled.mechanisms=SCRAM-SHA-512`` checks them."""
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        """Kept across stops: a start on the same dir restarts the same cluster (same
        cluster id, ports and topics, offsets and messages) instead of a new one."""

    # ---- public API

    @property
    def bootstrap(self) -> str:
        if self._proc is None:
            raise BrokerError("broker not started")
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        if self.workdir is None:
            raise BrokerError("broker not started")
        return self.workdir / "server.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalKafka:
        if self._proc is not None:
            return self
        java = _require("java")
        if (major := _java_major(java)) < 17:
            raise BrokerError(f"Kafka {self.version} needs Java 17+, found {major}; {APT_HINT}")
        libs = fetch_jars(self.version)
        _reap_stale_data_dirs()
        attempts = 1 if self._fixed_port else 3  # retry only races on random ports
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(java, libs)
                return self
            except BrokerError as exc:
                bind_race = "BindException" in str(exc) or "Address already in use" in str(exc)
                self.stop()
                if not bind_race or attempt == attempts:
                    raise
                log.info("port race while starting Kafka, retrying")
        return self  # pragma: no cover - loop always returns or raises

    def kill(self) -> None:
        """SIGKILL the broker (a crash); with ``data_dir`` its data stays for a restart."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        """SIGTERM the broker's process group, SIGKILL after ``stop_timeout``; drop the
        data unless it lives in ``data_dir``."""
        proc, self._proc = self._proc, None
        if proc is not None:
            LocalKafka._running.discard(self)
            pgid = proc.pid  # start_new_session: the broker leads its own group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("Kafka did not stop within %.0fs; killing it", self.stop_timeout)
            # Whatever is left in the group (the JVM if it hung, or any child) goes now.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if self.workdir is not None:
            if self.data_dir is None:
                shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        """Last lines of the broker log and of the JVM's own stdout/stderr."""
        if self.workdir is None:
            return ""
        parts = []
        for name in ("server.log", "stdout.log"):
            f = self.workdir / name
            if f.is_file():
                text = f.read_text(errors="replace").splitlines()[-lines:]
                if text:
                    parts.append(f"--- {f}\n" + "\n".join(text))
        return "\n".join(parts)

    # ---- internals

    def _start_once(self, java: str, libs: Path) -> None:
        saved: dict[str, str] = {}
        if self.data_dir is not None:
            self.workdir = self.data_dir
            self.workdir.mkdir(parents=True, exist_ok=True)
            state = self.workdir / "c4stream-broker.properties"
            if state.is_file():  # a restart: same ports, same cluster
                saved = dict(
                    line.split("=", 1) for line in state.read_text().splitlines() if "=" in line
                )
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix=DATA_DIR_PREFIX))
            (self.workdir / "owner.pid").write_text(str(os.getpid()))
        self.port = self._fixed_port or int(saved.get("port", 0)) or _free_port()
        self.controller_port = int(saved.get("controller_port", 0)) or _free_port()
        while self.controller_port == self.port:
            self.controller_port = _free_port()
        formatted = bool(saved) and (self.workdir / "metadata" / "meta.properties").is_file()
        if self.data_dir is not None:
            (self.workdir / "c4stream-broker.properties").write_text(
                f"port={self.port}\ncontroller_port={self.controller_port}\n"
            )
        config = self.workdir / "server.properties"
        config.write_text(self._server_properties())
        log4j = self.workdir / "log4j2.properties"
        log4j.write_text(_LOG4J2.format(log=self.log_file))

        base = [
            java,
            f"-Xmx{self.heap}",
            "-Xms256m",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={log4j}",
            f"-Dkafka.logs.dir={self.workdir}",
            "-cp",
            str(libs / "*"),
        ]

        if not formatted:  # a new cluster; a restart on data_dir keeps its id and data
            fmt = subprocess.run(
                [
                    *base,
                    "kafka.tools.StorageTool",
                    "format",
                    "--standalone",
                    "-t",
                    _cluster_id(),
                    "-c",
                    str(config),
                    *scram_arguments(self.scram_users),
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if fmt.returncode != 0:
                raise BrokerError(
                    "formatting Kafka storage failed:\n" + (fmt.stdout + fmt.stderr)[-3000:]
                )

        with open(self.workdir / "stdout.log", "wb") as out:
            self._proc = subprocess.Popen(
                [*base, "kafka.Kafka", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,  # own process group: stop() kills all of it
                # PDEATHSIG follows the *thread* that forked; only safe from main.
                preexec_fn=_set_pdeathsig
                if threading.current_thread() is threading.main_thread()
                else None,
            )
        LocalKafka._running.add(self)
        self._wait_ready()

    def _server_properties(self) -> str:
        assert self.workdir is not None
        p, c = self.port, self.controller_port
        props: dict[str, object] = {
            "process.roles": "broker,controller",
            "node.id": 1,
            # Kafka 4 dynamic quorum: `format --standalone` makes this node the voter.
            "controller.quorum.bootstrap.servers": f"127.0.0.1:{c}",
            "listeners": f"PLAINTEXT://127.0.0.1:{p},CONTROLLER://127.0.0.1:{c}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{p},CONTROLLER://127.0.0.1:{c}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": self.workdir / "data",
            "metadata.log.dir": self.workdir / "metadata",
            "num.partitions": 1,
            "default.replication.factor": 1,
            "min.insync.replicas": 1,
            "auto.create.topics.enable": "true",  # see module docstring
            "delete.topic.enable": "true",
            "offsets.topic.replication.factor": 1,
            "offsets.topic.num.partitions": 4,  # default 50 slows the first group join
            "transaction.state.log.replication.factor": 1,
            "transaction.state.log.min.isr": 1,
            "transaction.state.log.num.partitions": 4,
            "share.coordinator.state.topic.replication.factor": 1,
            "share.coordinator.state.topic.min.isr": 1,
            "group.share.enable": "false",
            "group.initial.rebalance.delay.ms": 0,
            # Small and short-lived: it is a test/demo broker in a temp dir.
            "num.network.threads": 2,
            "num.io.threads": 4,
            "log.segment.bytes": 16 * 1024 * 1024,
            "log.retention.hours": 2,
            "log.retention.check.interval.ms": 60_000,
        }
        if self.secure_listener:
            extra = dict(self.secure_listener)
            sp = extra.pop("port")
            proto = extra.pop("protocol", "SASL_SSL").upper()
            if proto not in ("SSL", "SASL_SSL"):
                raise BrokerError(f"secure listener protocol {proto!r}: SSL or SASL_SSL")
            props["listeners"] = f"{props['listeners']},{proto}://127.0.0.1:{sp}"
            props["advertised.listeners"] = (
                f"{props['advertised.listeners']},{proto}://127.0.0.1:{sp}"
            )
            props["listener.security.protocol.map"] += f",{proto}:{proto}"
            props.update(extra)
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout

        def check_alive() -> None:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise BrokerError(
                    f"Kafka exited with code {self._proc.returncode} while "
                    f"starting; log tail:\n{self.log_tail()}"
                )

        # First wait for the port to accept TCP, so librdkafka doesn't log a storm of
        # "connection refused" while the JVM boots.
        while True:
            check_alive()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise BrokerError(self._timeout_msg()) from None
                time.sleep(0.1)

        # librdkafka's lines while the broker comes up go to this module's log, not stderr
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "logger": log})
        while True:
            check_alive()
            try:
                md = admin.list_topics(timeout=2)
                if md.brokers:
                    return
            except KafkaException:
                pass
            if time.monotonic() > deadline:
                raise BrokerError(self._timeout_msg())
            time.sleep(0.1)

    def _timeout_msg(self) -> str:
        return (
            f"Kafka did not become ready on {self.bootstrap} within "
            f"{self.startup_timeout:.0f}s; log tail:\n{self.log_tail()}"
        )


@atexit.register
def _stop_all() -> None:
    # Brokers still running when Python exits normally (or via sys.exit) are stopped.
    for broker in list(LocalKafka._running):
        broker.stop()


# --------------------------------------------------------------------------- topics


# create_topics lives in c4base.kafka_admin (the worker and the demo use it too);
# it is re-exported here for the test fixtures.


# --------------------------------------------------------------------------- choice


def _docker_reachable() -> bool:
    try:
        import docker

        return bool(docker.from_env(timeout=2).ping())
    except Exception:  # any failure just means "no Docker"
        return False


@contextlib.contextmanager
def _docker_kafka() -> Iterator[str]:
    try:
        from testcontainers.community.kafka import KafkaContainer  # type: ignore[import-not-found]
    except ImportError:  # older testcontainers layout
        from testcontainers.kafka import KafkaContainer  # type: ignore[import-not-found,no-redef]
    with KafkaContainer().with_kraft() as kafka:
        yield str(kafka.get_bootstrap_server())


@contextlib.contextmanager
def ensure_broker(startup_timeout: float = 60.0) -> Iterator[str]:
    """Yield a bootstrap address, starting a broker only when needed.

    1. ``KAFKA_BOOTSTRAP`` set: use that cluster, start nothing.
    2. ``C4STREAM_USE_DOCKER=1`` and a Docker engine answers: testcontainers' Kafka.
    3. Otherwise: :class:`LocalKafka` (Java + the cached jars; no Docker).
    """
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    if os.environ.get("C4STREAM_USE_DOCKER") == "1" and _docker_reachable():
        with _docker_kafka() as bootstrap:
            yield bootstrap
        return
    with LocalKafka(startup_timeout=startup_timeout) as kafka:
        yield kafka.bootstrap


#: The tests' name for the same logic.
broker_for_tests = ensure_broker


if __name__ == "__main__":  # python -m compose.local_broker: quick manual check
    logging.basicConfig(level=logging.INFO)
    t0 = time.monotonic()
    with LocalKafka() as k:
        print(f"{k.bootstrap} ready in {time.monotonic() - t0:.1f}s", file=sys.stderr)
