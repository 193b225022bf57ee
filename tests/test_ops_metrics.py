"""Metrics endpoints of the services, scraped over real HTTP while the services run as
subprocesses against the real broker; the lag monitor against the real broker too."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from c4base.consumer_lag import LagMonitor
from c4base.metrics import Metrics
from streams.commands import IsolationCommand, encode_command

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[1]
INSPECTOR = REPO / "tests/producers/data/inspector/nccl-inspector-4242/node-001-pid1001.log"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> Samples:
    """Every sample of http://127.0.0.1:PORT/metrics as {(name, labels): value}."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2.0).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_scrape(
    port: int, proc: subprocess.Popen, done: Callable[[Samples], bool], timeout: float
) -> Samples:
    deadline = time.monotonic() + timeout
    samples: Samples = {}
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"service exited with {proc.returncode}"
        try:
            samples = scrape(port)
        except httpx.TransportError:  # not listening yet
            time.sleep(0.2)
            continue
        if done(samples):
            return samples
        time.sleep(0.3)
    raise AssertionError(f"metrics never got there; last scrape: {samples}")


def listen_addresses(port: int) -> set[str]:
    """Local addresses listening on TCP ``port``, from /proc/net/tcp{,6}."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A = LISTEN
                if len(addr) == 8:  # IPv4, little-endian bytes
                    out.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
                else:
                    out.add(addr)
    return out


def assert_loopback_only(port: int) -> None:
    if not Path("/proc/net/tcp").exists():
        pytest.skip("no /proc/net/tcp to read listening addresses from")
    assert listen_addresses(port) == {"127.0.0.1"}


def start(args: list[str], log: Path, **extra_env: str) -> subprocess.Popen:
    """``c4stream ARGS`` with no Kafka settings from the environment (only args/files)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("C4STREAM__") and k != "KAFKA_BOOTSTRAP"
    }
    env.update(extra_env)
    return subprocess.Popen(
        [sys.executable, "-m", "c4stream", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def json_log_lines(log: Path) -> list[dict[str, Any]]:
    # librdkafka writes its own %N|… lines to stderr; ours are the JSON objects
    return [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for v in values:
        p.produce(topic, v, key=b"k")
    assert p.flush(30) == 0


# ------------------------------------------------------------------ actuator


@pytest.mark.timeout(60)
def test_actuator_metrics(
    kafka_bootstrap: str, make_topics: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    topics = make_topics({"isolations": 1, "deadletter": 1})
    sent_us = int(time.time() * 1e6) - 2_000_000  # decided 2 s ago
    cmds = [
        IsolationCommand(
            id=f"c4-{i}", ts_us=sent_us, job="j", host=f"node00{i}", fault="straggler",
            action="cordon", confidence=0.9, reason="arrives last", evidence={},
        )
        for i in range(3)
    ]  # fmt: skip
    produce(kafka_bootstrap, topics["isolations"], [*map(encode_command, cmds), b"{not a command"])
    # Topics, backend and log format from the one config file; the port from the flag.
    config = tmp_path / "c4stream.toml"
    config.write_text(
        f'[kafka]\nbootstrap = "{kafka_bootstrap}"\n'
        "[log]\njson = true\n"
        f'[actuator]\nbackend = "command"\ngroup = "ops-{uuid.uuid4().hex[:8]}"\n'
        f'isolations = "{topics["isolations"]}"\ndeadletter = "{topics["deadletter"]}"\n'
        f'ledger_path = "{tmp_path / "ledger.sqlite3"}"\n'
        '[actuator.command]\ntemplate = "echo drain {host}"\n'
    )
    port = free_port()
    log = tmp_path / "actuator.log"
    proc = start(["actuate", "--config", str(config), "--metrics-port", str(port)], log)
    try:
        s = wait_scrape(
            port,
            proc,
            lambda s: (
                value(s, "c4stream_messages_in_total", stage="actuator") >= 4
                and value(s, "c4stream_deadletters_total", stage="actuator") >= 1
                # lag is sampled every 5 s: wait for a sample taken after the assignment
                and any(n == "c4stream_consumer_lag" for n, _ in s)
            ),
            timeout=40,
        )
        assert value(s, "c4stream_messages_in_total", stage="actuator") == 4
        assert value(s, "c4stream_deadletters_total", stage="actuator") == 1
        assert (
            value(
                s, "c4stream_isolations_total", stage="actuator", fault="straggler", action="cordon"
            )
            == 3
        )
        assert value(s, "c4stream_sink_actions_total", stage="actuator", outcome="dry_run") == 3
        # Exported at 0 from the start (issue 13): a panel shows 0, not "No data".
        failed = (
            "c4stream_sink_actions_total",
            frozenset({"stage": "actuator", "outcome": "failed"}.items()),
        )
        assert s.get(failed) == 0
        assert value(s, "c4stream_processing_latency_seconds_count", stage="actuator") == 3
        # latency is measured from the command's ts_us: at least the 2 s it waited
        assert value(s, "c4stream_processing_latency_seconds_sum", stage="actuator") >= 3 * 2.0
        lag = {
            frozenset(ls): v
            for (n, ls), v in s.items()
            if n == "c4stream_consumer_lag" and ("stage", "actuator") in ls
        }
        key = frozenset(
            {"stage": "actuator", "topic": topics["isolations"], "partition": "0"}.items()
        )
        assert list(lag) == [key]
        assert lag[key] in (0, 4)  # all consumed, or a sample taken right at the assignment
        assert_loopback_only(port)
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-2000:]
    records = json_log_lines(log)
    assert any("DRY-RUN" in r["msg"] for r in records), log.read_text()[-2000:]
    assert any(r["msg"].startswith("metrics on http://127.0.0.1:") for r in records)


# ------------------------------------------------------------------ exporter


@pytest.mark.timeout(60)
def test_exporter_metrics(
    kafka_bootstrap: str, make_topics: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    topics = make_topics({"events": 1, "deadletter": 1})
    dump = tmp_path / "nccl-inspector-77"
    dump.mkdir()
    good = INSPECTOR.read_bytes().splitlines(keepends=True)
    (dump / "node-001-pid1001.log").write_bytes(b"".join(good) + b"this is not json\n")
    port = free_port()
    log = tmp_path / "exporter.log"
    proc = start(
        [
            *("exporter", "--dir", str(dump), "--bootstrap", kafka_bootstrap),
            *("--topic", topics["events"], "--deadletter-topic", topics["deadletter"]),
            *("--interval", "0.2", "--state-file", str(tmp_path / "state.json")),
            *("--metrics-port", str(port), "--log-json"),
        ],
        log,
    )
    try:
        s = wait_scrape(
            port,
            proc,
            lambda s: (
                value(s, "c4stream_events_in_total", stage="exporter") >= len(good)
                and value(s, "c4stream_deadletters_total", stage="exporter") >= 1
                and value(s, "c4stream_processing_latency_seconds_count", stage="exporter") >= 1
                # counters are synced once per loop step, after the acknowledgements
                and value(s, "c4stream_sink_actions_total", stage="exporter", outcome="delivered")
                >= 2
            ),
            timeout=40,
        )
        assert value(s, "c4stream_events_in_total", stage="exporter") == len(good)
        assert value(s, "c4stream_messages_in_total", stage="exporter") == len(good) + 1
        assert value(s, "c4stream_deadletters_total", stage="exporter") == 1
        # batches + the dead letter, all acknowledged by the broker
        assert value(s, "c4stream_sink_actions_total", stage="exporter", outcome="delivered") >= 2
        assert value(s, "c4stream_sink_actions_total", outcome="delivery_error") == 0
        assert_loopback_only(port)
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert json_log_lines(log), "--log-json gave no JSON log lines"


# ------------------------------------------------------------------ lag monitor


@pytest.mark.timeout(30)
def test_lag_monitor_reports_high_watermark_minus_position(
    kafka_bootstrap: str, make_topics: Callable[..., dict[str, str]]
) -> None:
    topic = make_topics({"t": 1})["t"]
    produce(kafka_bootstrap, topic, [b"m%d" % i for i in range(10)])
    c = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"lag-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    try:
        c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        got: list[Any] = []
        deadline = time.monotonic() + 20
        while len(got) < 4 and time.monotonic() < deadline:
            got += [m for m in c.consume(4 - len(got), 0.5) if m.error() is None]
        assert len(got) == 4
        metrics = Metrics()
        mon = LagMonitor(c, metrics, "test")
        assert mon.update() == {(topic, 0): 6}
        assert b'c4stream_consumer_lag{partition="0",stage="test",topic="' in metrics.render()
        c.unassign()
        assert mon.update() == {}
        assert b"c4stream_consumer_lag{" not in metrics.render()  # no stale series
    finally:
        c.close()


# ------------------------------------------------------------------ alerter


@pytest.mark.timeout(60)
def test_alerter_metrics_with_the_unified_config(kafka_bootstrap: str, tmp_path: Path) -> None:
    from c4base.topics import Topics
    from c4stream.demo.receiver import WebhookReceiver
    from compose.local_broker import create_topics
    from sinks.alert.samples import sample_command

    topics = Topics(prefix=f"ops-{uuid.uuid4().hex[:8]}.")
    create_topics(kafka_bootstrap, topics.partitions(), 30.0)
    produce(kafka_bootstrap, topics.isolations, [encode_command(sample_command("h1")), b"{bad"])
    with WebhookReceiver() as rx:
        config = tmp_path / "c4stream.toml"
        config.write_text(
            f'[kafka]\nbootstrap = "{kafka_bootstrap}"\ntopic_prefix = "{topics.prefix}"\n'
            f"[metrics]\nport = {free_port()}\n"  # overridden by the flag below
            '[alert]\n[[alert.destination]]\ntype = "slack"\nurl_env = "C4_OPS_HOOK"\n'
        )
        port = free_port()
        log = tmp_path / "alerter.log"
        proc = start(
            [
                *("alert", "--config", str(config), "--from-beginning"),
                *("--group", f"ops-{uuid.uuid4().hex[:6]}", "--metrics-port", str(port)),
            ],
            log,
            C4_OPS_HOOK=rx.url + "/hook",
        )
        try:
            s = wait_scrape(
                port,
                proc,
                lambda s: (
                    value(s, "c4stream_messages_in_total", stage="alerter") >= 2
                    and value(
                        s, "c4stream_sink_actions_total", stage="alerter", outcome="delivered"
                    )
                    >= 1
                ),
                timeout=40,
            )
            assert value(s, "c4stream_deadletters_total", stage="alerter") == 1
            assert value(s, "c4stream_isolations_total", stage="alerter", fault="straggler") == 1
            assert value(s, "c4stream_processing_latency_seconds_count", stage="alerter") == 1
            assert rx.received and rx.received[0]["path"] == "/hook"
            assert_loopback_only(port)
        finally:
            stop(proc)
    assert proc.returncode == 0, log.read_text()[-2000:]


# ------------------------------------------------------------------ worker


@pytest.mark.timeout(90)
def test_worker_metrics_from_flags(kafka_bootstrap: str, tmp_path: Path) -> None:
    from producers.events import ProgressEvent, encode_message

    prefix = f"opsw{uuid.uuid4().hex[:6]}."
    port = free_port()
    log = tmp_path / "worker.log"
    proc = start(
        [
            *("worker", "--bootstrap", kafka_bootstrap, "--topic-prefix", prefix),
            *("--workdir", str(tmp_path / "w"), "--metrics-port", str(port), "--log-json"),
        ],
        log,
    )
    try:
        events = [
            ProgressEvent(v=1, job="j", comm="0xa", nranks=2, rank=r, host=f"node-{r}",
                          ts_us=int(time.time() * 1e6), started=3, completed=3)
            for r in range(2)
        ]  # fmt: skip
        # The worker creates its topics at start; produce once they exist.
        deadline = time.monotonic() + 60
        while not (tmp_path / "w" / "status.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        produce(kafka_bootstrap, f"{prefix}c4.events", [encode_message(events), b"[{oops"])
        s = wait_scrape(
            port,
            proc,
            lambda s: (
                value(s, "c4stream_events_in_total", stage="worker") >= 2
                and value(s, "c4stream_deadletters_total", stage="worker") >= 1
            ),
            timeout=60,
        )
        assert value(s, "c4stream_events_in_total", stage="worker") == 2
        assert value(s, "c4stream_deadletters_total", stage="worker") == 1
        assert_loopback_only(port)
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert json_log_lines(log), "--log-json gave no JSON log lines"
