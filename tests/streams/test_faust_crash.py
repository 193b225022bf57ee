"""An agent whose body raises: Faust commits the batch unread; the worker stops instead.

Faust acks a ``take_events`` batch in the generator's ``finally`` and restarts a crashed
agent on the next batch, so the failed batch is committed without being handled.
``streams.app.faust_adapter.stop_on_crash`` ends the process first (status 1, as a
sink's ``FatalError``), and a restart reads the batch again. Both run here on the real
broker as a child process (``python tests/streams/test_faust_crash.py BOOTSTRAP TOPIC
GROUP WORKDIR guarded|bare``): ten messages, batches of five, the first batch raises.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _child(bootstrap: str, topic: str, group: str, workdir: str, mode: str) -> None:
    import signal
    import time

    import faust

    from c4base import lifeguard
    from streams.app.faust_adapter import stop_on_crash

    app = faust.App(
        group,
        broker=f"kafka://{bootstrap}",
        store="memory://",
        datadir=workdir,
        web_enabled=False,
        broker_commit_interval=0.2,
        consumer_auto_offset_reset="earliest",
        topic_partitions=1,
        autodiscover=False,
    )
    topic_t = app.topic(topic, value_type=bytes, value_serializer="raw", key_serializer="raw")
    batches: list[list[int]] = []

    async def body(stream: object) -> None:
        async for batch in stream.take_events(5, within=0.5):  # type: ignore[attr-defined]
            batches.append([e.message.offset for e in batch])
            print("batch", batches[-1], flush=True)
            if len(batches) == 1:
                raise RuntimeError("the first batch fails")

    def crashed(name: str, err: BaseException) -> None:
        lifeguard.exit_fatal(f"agent {name} failed: {err}")

    app.agent(topic_t, name="probe")(stop_on_crash(crashed)(body) if mode == "guarded" else body)
    start = time.monotonic()

    @app.timer(interval=0.5)
    async def stop_later() -> None:  # a clean stop commits what Faust acked
        waited = time.monotonic() - start
        if (waited > 10 and len(batches) >= 2) or waited > 40:
            os.kill(os.getpid(), signal.SIGTERM)

    faust.Worker(
        app, loglevel="warning", quiet=True, redirect_stdouts=False
    ).execute_from_commandline()


def _committed(bootstrap: str, group: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    (tp,) = c.committed([TopicPartition(topic, 0)], timeout=10)
    c.close()
    return tp.offset


def _run(bootstrap: str, topic: str, tmp_path: Path, mode: str) -> tuple[int, str, int]:
    group = f"crash-{mode}-{uuid.uuid4().hex[:6]}"
    proc = subprocess.run(
        [sys.executable, __file__, bootstrap, topic, group, str(tmp_path / group), mode],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr, _committed(bootstrap, group, topic)


@pytest.mark.timeout(300)
def test_a_failed_batch_is_not_committed_unread(
    make_topics, kafka_bootstrap: str, tmp_path: Path
) -> None:
    from confluent_kafka import Producer

    topic = make_topics({"events": 1})["events"]
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in range(10):
        p.produce(topic, b"%d" % i)
    assert p.flush(10) == 0

    code, out, committed = _run(kafka_bootstrap, topic, tmp_path, "bare")
    # Faust alone: the restarted agent read 5-9 and the group committed past 0-4.
    assert "batch [5, 6, 7, 8, 9]" in out and committed == 10, out[-3000:]

    code, out, committed = _run(kafka_bootstrap, topic, tmp_path, "guarded")
    assert code == 1, out[-3000:]
    assert "agent body failed: the first batch fails" in out
    assert "batch [5, 6, 7, 8, 9]" not in out
    assert committed < 0, committed  # nothing committed: a restart reads 0-4 again


if __name__ == "__main__":
    _child(*sys.argv[1:6])
