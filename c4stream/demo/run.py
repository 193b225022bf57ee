"""The demo: a simulated 128-GPU job with injected faults, through the real pipeline.

Steps: simulate a trace → start a Kafka broker (local, or ``KAFKA_BOOTSTRAP``) → start
worker, archiver, actuator (dry run, restarting the job after an isolation) and alerter
as child services, with a local webhook receiver standing in for the ops chat → replay
the trace into ``c4.events`` → show isolation commands live as they come out of
``c4.isolations`` → stop everything → write the HTML report, with the loop (fault →
decision → isolation → restart) on one timeline, and compare what was decided with what
was injected.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from c4base.kafka import KafkaConfig
from c4base.topics import Topics
from c4stream.demo.receiver import WebhookReceiver
from c4stream.demo.services import ServiceGroup
from compose.local_broker import create_topics, ensure_broker
from producers.replay import ReplayConfig, replay
from producers.simulator import SCENARIOS, with_gpus, write_trace
from producers.traces import iter_events
from sinks.actuator.ledger import Ledger
from sinks.actuator.restart import RestartLog
from sinks.report import LoopStep, lateness_maps, write_report
from streams.commands import CommandDecodeError, IsolationCommand, decode_command
from streams.scoring import TruthFault, component_label, score_commands, truth_faults

__all__ = ["DemoConfig", "DemoResult", "run_demo"]

ALERTS_SETTLE_S = 5.0
"""After the last decision, wait at most this long for its chat post."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    out_dir: Path = Path("demo-out")
    scenario: str = "demo"
    gpus: int = 128
    duration_s: float | None = None
    """Simulated seconds; None keeps the scenario's own."""
    seed: int = 0
    speed: float = 6.0
    """Trace seconds replayed per wall second."""
    settle_s: float = 20.0
    """After the replay, wait this long (at most) for the last decisions."""
    bootstrap: str | None = None


@dataclass
class DemoResult:
    commands: list[IsolationCommand] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    truth: dict[str, Any] = field(default_factory=dict)
    report: Path | None = None
    archive: Path | None = None
    matched: int = 0
    false_isolations: int = 0
    loop: list[LoopStep] = field(default_factory=list)
    """What the actuator did after each decision: isolation, job restart (dry run)."""


class _IsolationWatcher(threading.Thread):
    """Reads ``c4.isolations`` in the background and keeps the decoded commands."""

    def __init__(self, kafka: KafkaConfig, topic: str) -> None:
        super().__init__(daemon=True, name="isolation-watcher")
        self.kafka, self.topic = kafka, topic
        self.commands: list[IsolationCommand] = []
        self.published_us: dict[str, int] = {}
        """Command id -> when the worker published it (the Kafka message timestamp)."""
        self.bad = 0
        self._stopping = threading.Event()

    def run(self) -> None:
        from confluent_kafka import Consumer

        consumer = Consumer(
            self.kafka.consumer_config(f"c4stream-demo-{time.time_ns()}"),
            logger=logging.getLogger("c4stream.demo.rdkafka"),
        )
        consumer.subscribe([self.topic])
        try:
            while not self._stopping.is_set():
                msg = consumer.poll(0.3)
                if msg is None or msg.error():
                    continue
                try:
                    cmd = decode_command(msg.value())
                except CommandDecodeError:
                    self.bad += 1
                    continue
                self.commands.append(cmd)
                kind, ms = msg.timestamp()
                if kind != 0:  # 0: TIMESTAMP_NOT_AVAILABLE
                    self.published_us.setdefault(cmd.id, ms * 1000)
        finally:
            consumer.close()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)


class _Replayer(threading.Thread):
    """Replays the trace in the background; an error there is raised in the caller."""

    def __init__(self, trace: Path, config: Any) -> None:
        super().__init__(daemon=True, name="replay")
        self.trace, self.config = trace, config
        self.stats: Any = None
        self.error: BaseException | None = None
        self._t0 = time.monotonic()

    def run(self) -> None:

        self._t0 = time.monotonic()
        try:
            self.stats = replay([self.trace], self.config)
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            self.error = err

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"replaying {self.trace} failed: {self.error}") from self.error


def _commands_view(cmds: list[IsolationCommand], t0_us: int) -> Group:
    """A compact table (fits 80 columns) with each decision's reason below it."""
    table = Table(title="What c4stream decided")
    for col in ("#", "t (s)", "host", "component", "fault", "action", "conf."):
        # Never wrapped: a narrow terminal must not cut "GPU 5" down to "5".
        table.add_column(col, no_wrap=col in ("host", "component", "fault"))
    reasons: list[Text] = []
    for i, c in enumerate(sorted(cmds, key=lambda c: c.ts_us), 1):
        comp = component_label(c.gpu, c.nic, c.peer_host, c.fault)
        action = c.action + (" (dry run)" if c.dry_run else "")
        table.add_row(
            str(i),
            f"{(c.ts_us - t0_us) / 1e6:.1f}",
            c.host,
            comp,
            c.fault,
            action,
            f"{c.confidence:.2f}",
        )
        reasons.append(Text(f"{i}. {c.reason}"))
    return Group(table, *reasons)


def _truth_table(result: DemoResult, t0_us: int) -> Table:
    table = Table(title="Injected faults vs decisions, and what the actuator did")
    cols = ("injected at (s)", "fault", "host", "component", "found", "latency (s)")
    for col in (*cols, "isolated", "restart"):
        table.add_column(col, no_wrap=col in ("host", "component", "fault"))
    steps = {(s.cmd_id, s.stage): s.status.replace("_", " ") for s in result.loop}
    score = score_commands(result.commands, result.truth)
    for f, fs in zip(truth_faults(result.truth), score.faults, strict=True):
        first = _first_decision(result.commands, f)
        table.add_row(
            f"{(f.start_us - t0_us) / 1e6:.1f}",
            f.expected_fault,
            f.host,
            component_label(f.gpu, f.nic, f.peer_host, f.expected_fault),
            "[green]yes[/]" if fs.found else "[red]no[/]",
            f"{fs.latency_s:.1f}" if fs.found and fs.latency_s is not None else "-",
            steps.get((first, "isolate"), "-"),
            steps.get((first, "restart"), "-"),
        )
    return table


def _first_decision(cmds: list[IsolationCommand], f: TruthFault) -> str:
    """The id of the first command naming the fault's host (either end of a link) with
    its class, from the fault's start on: the decision whose loop the table shows."""
    ends = {f.host, f.peer_host} - {None}
    hits = [
        c
        for c in cmds
        if c.fault == f.expected_fault
        and c.ts_us >= f.start_us - 1_000_000
        and (c.host in ends or c.peer_host in ends)
    ]
    return min(hits, key=lambda c: c.ts_us).id if hits else ""


def _loop_steps(
    ledger: Path, cmds: list[IsolationCommand], published_us: dict[str, int]
) -> list[LoopStep]:
    """The actuator's isolations and restarts, placed on the trace's timeline.

    A step's wall-clock delay after the command was published (Kafka timestamp) is added
    to the decision's event time. The isolation's ledger row is written after the restart
    (crash safety, see sinks.actuator.restart), so the isolation is placed no later than
    the restart it preceded.
    """
    if not ledger.exists():
        return []
    by_id = {c.id: c for c in cmds}

    def at(cmd_id: str, wall_us: int) -> int:
        pub = published_us.get(cmd_id)
        return by_id[cmd_id].ts_us + (max(0, wall_us - pub) if pub is not None else 0)

    with RestartLog(ledger) as rl:
        restarts = {e.id: e for e in rl.entries() if e.id in by_id}
    with Ledger(ledger) as led:
        isolations = [e for e in led.entries() if e.id in by_id]
    steps = []
    for e in isolations:
        wall = min(e.first_us, restarts[e.id].first_us) if e.id in restarts else e.first_us
        detail = e.detail.split("; job restart ", 1)[0]  # the restart has its own step
        steps.append(LoopStep(e.id, e.host, "isolate", at(e.id, wall), e.status, detail))
    for r in restarts.values():
        steps.append(LoopStep(r.id, r.host, "restart", at(r.id, r.first_us), r.status, r.detail))
    return sorted(steps, key=lambda s: s.ts_us)


def _start_services(svc: ServiceGroup, bootstrap: str, out: Path, chat_url: str, job: str) -> None:
    alert_toml = out / "alert.toml"
    alert_toml.write_text(
        "resolve_timeout_s = 120\n"
        f'[[destination]]\ntype = "alertmanager_webhook"\nurl = "{chat_url}/alertmanager"\n'
        f'[[destination]]\ntype = "slack"\nurl = "{chat_url}/slack"\n'
    )
    kafka = ("--bootstrap", bootstrap)
    svc.start("worker", "worker", *kafka, "--workdir", str(out / "worker"))
    svc.start("archiver", "archive", *kafka, "--out", str(out / "archive"))
    # Dry run (the default): the actuator logs the scontrol lines it would run — the
    # drain, then the requeue of the job that ran on the drained node. The trace runs
    # several times faster than real time and decisions can come out in a burst, so the
    # "restart in progress" rail (900 s by default) is off here: each injected fault
    # shows its own restart. tests/sinks/test_actuator_restart.py covers the rail.
    drain = 'scontrol update nodename={host} state=drain reason="{reason}"'
    ledger = str(out / "actuator-ledger.sqlite")
    svc.start("actuator", "actuate", *kafka, "--backend", "command", "--command-template", drain,
              "--ledger", ledger, "--restart-jobs", job,
              "--requeue-template", "scontrol requeue {jobid}",
              "--jobid-lookup", "squeue -h -w {host} -n {job} -o %i",
              "--restart-in-progress", "0",
              "--restart-max-per-hour", "10")  # fmt: skip
    svc.start("alerter", "alert", *kafka, "--config", str(alert_toml))


def _all_found(cmds: list[IsolationCommand], truth: dict[str, Any]) -> bool:
    return score_commands(cmds, truth).all_found


@contextlib.contextmanager
def _logs_to_file(path: Path) -> Iterator[None]:
    """Log lines of this process (the replay's producer, the watcher's consumer, topic
    creation: librdkafka's "Failed to acquire idempotence PID … retrying" while the
    broker starts) go to ``path``, as each service's go to its own log, not between the
    demo's tables. The root logger gets a file handler for the run and loses it after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def run_demo(config: DemoConfig, console: Console | None = None) -> DemoResult:
    """Run the whole demo; every child process is stopped before this returns."""

    console = console or Console()
    out = config.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult()

    # 1. The job: a simulated trace and the ground truth of what was injected.
    sim = with_gpus(SCENARIOS[config.scenario], config.gpus)
    sim = msgspec.structs.replace(
        sim, seed=config.seed, duration_s=config.duration_s or sim.duration_s
    )
    trace, truth_path = out / "trace.jsonl.gz", out / "truth.json"
    with console.status(f"simulating {config.gpus} GPUs for {sim.duration_s:.0f} s …"):
        write_trace(sim, trace, truth_path)
    result.truth = msgspec.json.decode(truth_path.read_bytes())
    t0_us = int(result.truth.get("epoch_us", 0))
    console.print(
        f"[bold]1[/] simulated job → {trace} (faults: "
        + ", ".join(f"{f['expected_fault']}@{f['host']}" for f in result.truth["faults"])
        + ")"
    )

    # 2. Kafka, topics, the stand-in chat, and the services; all stopped on the way out.
    with contextlib.ExitStack() as stack:
        stack.enter_context(_logs_to_file(out / "logs" / "demo.log"))
        if config.bootstrap is None:
            with console.status("starting Kafka …"):
                bootstrap = stack.enter_context(ensure_broker())
        else:
            bootstrap = config.bootstrap
        topics = Topics()
        create_topics(bootstrap, topics.partitions(), 60.0)
        console.print(f"[bold]2[/] Kafka at {bootstrap}; topics {', '.join(topics.partitions())}")
        kafka = KafkaConfig(bootstrap=bootstrap)
        chat = stack.enter_context(WebhookReceiver())
        svc = stack.enter_context(ServiceGroup(out / "logs", env={"KAFKA_BOOTSTRAP": bootstrap}))
        _start_services(svc, bootstrap, out, chat.url, sim.job)
        console.print(
            f"[bold]3[/] services up (logs in {out / 'logs'}): worker, archiver, "
            f"actuator (dry run), alerter → {chat.url}"
        )
        watcher = _IsolationWatcher(kafka, topics.isolations)
        watcher.start()
        stack.callback(watcher.stop)

        # 3. Replay the trace at `speed`, showing decisions as they arrive.
        replayer = _Replayer(trace, ReplayConfig(kafka=kafka, speed=config.speed, progress=False))
        replayer.start()
        settle_until: float | None = None
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while True:
                svc.check()
                trace_s = min(replayer.elapsed() * config.speed, sim.duration_s)
                status = Text(
                    f"replaying at {config.speed:g}× · trace time {trace_s:5.1f}/"
                    f"{sim.duration_s:.0f} s · decisions {len(watcher.commands)} · "
                    f"chat posts {len(chat.received)}"
                    + (" · waiting for the last decisions" if settle_until else "")
                )
                live.update(Group(status, _commands_view(watcher.commands, t0_us)))
                if not replayer.is_alive():
                    replayer.raise_if_failed()
                    # Give the worker a moment after the replay; stop early once
                    # every injected fault has its decision.
                    settle_until = settle_until or time.monotonic() + config.settle_s
                    if time.monotonic() > settle_until or _all_found(
                        watcher.commands, result.truth
                    ):
                        break
                time.sleep(0.25)
        console.line()
        stats = replayer.stats
        if stats is not None:
            console.print(
                f"replayed {stats.events:,} events in {stats.messages:,} messages "
                f"({stats.bad} bad lines)"
            )
        watcher.stop()
        result.commands = list(watcher.commands)
        # The alerter posts a decision a moment after the watcher sees it: give the
        # chat posts naming every decided host a few seconds to arrive.
        posted_by = time.monotonic() + ALERTS_SETTLE_S
        while time.monotonic() < posted_by and not all(
            c.host in str([a["body"] for a in chat.received]) for c in result.commands
        ):
            time.sleep(0.1)
        result.alerts = list(chat.received)
        published_us = dict(watcher.published_us)
        console.print("stopping services and Kafka …")
    result.loop = _loop_steps(out / "actuator-ledger.sqlite", result.commands, published_us)

    # 4. The report.
    with console.status("writing the report …"):
        maps = lateness_maps(iter_events(trace))
        result.report = write_report(
            out / "report.html",
            maps,
            result.commands,
            truth=result.truth,
            title=f"c4stream demo — {config.gpus} GPUs, scenario {config.scenario}",
            loop=result.loop,
        )
    result.archive = out / "archive"
    score = score_commands(result.commands, result.truth)
    result.matched = sum(f.found for f in score.faults)
    result.false_isolations = score.false_isolations
    console.print(_truth_table(result, t0_us))
    console.print(
        f"found {result.matched}/{len(result.truth['faults'])} injected faults, "
        f"{result.false_isolations} false isolations, {len(result.alerts)} chat posts\n"
        f"report:  {result.report}\narchive: {result.archive}  (Parquet; docs/archive.md)\n"
        f"logs:    {out / 'logs'}"
    )
    return result
