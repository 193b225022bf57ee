"""Chaos rows of issue 25, item 5: no action and no alert repeated, nothing lost, after a
kill of the actuator between acting and recording, a slow webhook receiver, and a full
archive filesystem.

These rows drive the sinks directly through the real broker (the commands, alerts and
events a worker would publish are produced by the test), with the real processes,
programs and servers: the actuator is SIGKILLed by its test hook
(``C4STREAM_TEST_KILL_BEFORE_RECORD``) right after the command backend ran; the
receivers are HTTP servers on loopback; the archive is a real 4 MB tmpfs filled by a
ballast file. The sink tests (tests/sinks/test_actuator_exactly_once.py,
test_alert_slow_receiver.py, test_archive_disk_full.py) hold the finer assertions.

The columns, for these rows: sent = commands / alerts / event messages written;
dead-lettered = dead letters (actuator), alerts settled as not delivered (alerter);
lost = commands without a final ledger row, alerts the receiver never got, events
missing from the archive after the dedupe key; duplicated = a command's runs (drains)
beyond the first, posts of one notification (Idempotency-Key) beyond the first, archived
rows beyond the first per dedupe key after dedupe (the raw count is in the notes);
acted = actions that took effect; faults found = what arrived, out of what was sent.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka import Producer, TopicPartition

from c4base.kafka import KafkaConfig
from c4base.topics import Topics
from compose.local_broker import create_topics
from producers.events import encode_message
from sinks.actuator.ledger import FINAL, Ledger
from sinks.alert.config import Destination
from sinks.archive.dedupe import count_duplicates, drop_duplicates, open_dataset
from sinks.archive.writer import TEMP_SUFFIX
from tests.chaos.harness import ROWS, Row, deadletters
from tests.sinks.test_actuator_exactly_once import (
    LOGGING_PREFIX,
    command,
    config,
    lines,
    produce,
    recorder,
    run_until_done,
)
from tests.sinks.test_alert_slow_receiver import Receiver, deliver, notifications
from tests.sinks.test_archive_disk_full import fill, small_fs  # noqa: F401 (the fixture)
from tests.sinks.test_archive_kafka import committed, ends, start_archiver, trace_messages
from tests.slurm_fixture import SlurmCluster

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(240)
def test_actuator_sigkill_after_the_backend_ran_before_recording(
    kafka_bootstrap: str, make_topics: Callable[..., dict[str, str]], tmp_path: Path
) -> None:
    n = 6  # the probe's count
    topics = make_topics({"isolations": 1, "deadletter": 1, "actions": 1})
    tmpl, runs, effects = recorder(tmp_path)
    cmds = [command(i) for i in range(1, n + 1)]
    produce(kafka_bootstrap, topics["isolations"], cmds)
    extra = f"[actuator.command]\ntemplate = {json.dumps(tmpl)}\nidempotent = false\n"
    kills, _ = run_until_done(
        config(tmp_path, kafka_bootstrap, topics, "command", extra), {}, max_runs=n + 3
    )
    ran = Counter(r[0] for r in lines(runs))
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        final = {e.id: e.status for e in led.entries() if e.status in FINAL}
    dls = deadletters(kafka_bootstrap, topics["deadletter"], timeout=2.0)
    row = Row(
        "actuator SIGKILL after the command backend ran, before recording",
        sent=n,
        deadlettered=len(dls),
        lost=sum(1 for c in cmds if c.id not in final),
        duplicated=sum(v - 1 for v in ran.values()),
        acted=len(effects.read_text().split()),
        found=f"{len(ran)}/{n} ran once",
        notes=f"{kills} kills; each restart found one unfinished, ended "
        + ", ".join(f"{v} {k}" for k, v in sorted(Counter(final.values()).items()))
        + " (the command is not declared idempotent: not run again)",
    )
    ROWS.append(row)
    assert kills == n and row.duplicated == 0 and row.lost == 0 and row.acted == n


@pytest.mark.timeout(240)
def test_actuator_sigkill_after_scontrol_drained_before_recording(
    slurm_cluster: SlurmCluster,
    kafka_bootstrap: str,
    make_topics: Callable[..., dict[str, str]],
    tmp_path: Path,
) -> None:
    topics = make_topics({"isolations": 1, "deadletter": 1, "actions": 1})
    nodes = ["node-002", "node-003", "node-004"]
    cmds = [command(i, host=node) for i, node in enumerate(nodes, 1)]
    produce(kafka_bootstrap, topics["isolations"], cmds)
    prefix = tmp_path / "log-prefix.py"
    prefix.write_text(LOGGING_PREFIX)
    calls = tmp_path / "calls.jsonl"
    extra = (
        f'[actuator.slurm]\nslurm_conf = "{slurm_cluster.conf}"\n'
        f"command_prefix = [{json.dumps(sys.executable)}, {json.dumps(str(prefix))}]\n"
    )
    cfg = config(tmp_path, kafka_bootstrap, topics, "slurm", extra)
    kills, _ = run_until_done(cfg, {"C4_CALLS": str(calls)}, max_runs=len(nodes) + 3)
    drains = Counter(a[2] for a in lines(calls) if "update" in a)  # nodename=...
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        final = {e.id: e.status for e in led.entries() if e.status in FINAL}
    drained = sum("DRAIN" in slurm_cluster.node(x)["State"] for x in nodes)
    row = Row(
        "actuator SIGKILL after scontrol drained, before recording (real slurmctld)",
        sent=len(nodes),
        deadlettered=len(deadletters(kafka_bootstrap, topics["deadletter"], timeout=2.0)),
        lost=sum(1 for c in cmds if c.id not in final),
        duplicated=sum(v - 1 for v in drains.values()),
        acted=sum(drains.values()),
        found=f"{drained}/{len(nodes)} nodes drained",
        notes=f"{kills} kills; restarts read scontrol show node (DRAIN, our reason): done",
    )
    ROWS.append(row)
    assert kills == len(nodes) and row.duplicated == 0 and row.lost == 0
    assert drained == len(nodes) and set(final.values()) == {"done"}


@pytest.mark.timeout(120)
def test_webhook_receiver_slower_than_the_client_timeout(tmp_path: Path) -> None:
    """40 alerts of 40 hosts; the receiver answers after 2 s, the client gives up after
    0.5 s (the probe: 10 s against a 10 s timeout); a second, fast receiver beside it."""
    n, answer_s, timeout_s = 40, 2.0, 0.5
    with Receiver(answer_s) as slow, Receiver(0.0) as fast:
        dests = [
            Destination(type="slack", url=slow.url, name="slow", min_severity="info"),
            Destination(type="teams", url=fast.url, name="fast", min_severity="info"),
        ]
        d, done, t0 = asyncio.run(deliver(dests, notifications(n), timeout_s, wait_s=60))
        slow_posts, fast_posts = list(slow.posts), list(fast.posts)
    per_key = Counter(p[3] for p in slow_posts)
    late = max(p[0] for p in slow_posts) - t0
    bound = -(-n // dests[0].max_in_flight) * timeout_s + 2.0
    row = Row(
        "webhook receiver answering after the client's timeout (40 alerts)",
        sent=n,
        deadlettered=sum(not ok for ok, _ in done),
        lost=n - len(per_key),
        duplicated=sum(v - 1 for v in per_key.values()),
        found=f"{len(per_key)}/{n} posted; last {late:.1f} s after the first was queued "
        f"(bound {bound:.1f} s; serial: {n * timeout_s:.0f} s)",
        notes=f"{d.stats.unconfirmed} 'maybe delivered' (read timeout), not re-posted; "
        f"fast receiver beside it: {len(fast_posts)}/{n}, last "
        f"{max(p[0] for p in fast_posts) - t0:.1f} s",
    )
    ROWS.append(row)
    assert row.duplicated == 0 and row.lost == 0 and len(fast_posts) == n
    # parallel, whatever the machine's speed: one at a time (a request every 0.5 s, each
    # held 2 s) the receiver would hold at most 4 + 1 at once (the time is printed)
    assert slow.most_in_flight > answer_s / timeout_s + 1, slow.most_in_flight


@pytest.mark.timeout(180)
def test_archive_filesystem_full(kafka_bootstrap: str, small_fs: Path, tmp_path: Path) -> None:  # noqa: F811
    prefix = f"full{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix=prefix)
    create_topics(
        kafka_bootstrap,
        {topics.events: 2, topics.verdicts: 1, topics.isolations: 1, topics.deadletter: 1},
    )
    msgs = trace_messages()
    events = sum(len(m) for m in msgs)
    producer = Producer(KafkaConfig(bootstrap=kafka_bootstrap).producer_config(**{"linger.ms": 5}))
    for m in msgs:
        producer.produce(topics.events, encode_message(m), key=m[0].comm)
        producer.poll(0)
    assert producer.flush(30) == 0
    out, log = small_fs / "archive", tmp_path / "archiver.log"
    out.mkdir()
    ballast = fill(small_fs, leave_bytes=40_000)
    proc = start_archiver(kafka_bootstrap, prefix, out, log)
    tps = [TopicPartition(topics.events, p) for p in range(2)]
    temps_while_held = -1
    try:
        deadline = time.monotonic() + 60
        while "filesystem full" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(3.0)
        temps_while_held = len(list(out.rglob(f"*{TEMP_SUFFIX}")))
        ballast.unlink()
        want = ends(kafka_bootstrap, tps)
        deadline = time.monotonic() + 60
        while committed(kafka_bootstrap, f"{prefix}archive", tps) != want:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    table = open_dataset(out, "events").to_table()
    clean = drop_duplicates(table)
    temps = list(out.rglob(f"*{TEMP_SUFFIX}"))
    row = Row(
        "archive filesystem full (4 MB tmpfs), then freed",
        sent=len(msgs),
        deadlettered=0,
        lost=events - clean.num_rows,
        duplicated=count_duplicates(clean),
        found=f"{clean.num_rows}/{events} events archived",
        notes=f"exit {rc}, {text.count('Traceback')} tracebacks, {len(temps)} .inprogress left "
        f"({temps_while_held} while held); {count_duplicates(table)} duplicate rows before "
        "dedupe",
    )
    ROWS.append(row)
    assert rc == 0 and "Traceback" not in text and temps == []
    assert row.lost == 0 and row.duplicated == 0
