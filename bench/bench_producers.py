"""Producer throughput against a real broker: exporter and replay, events/s and messages/s.

* **replay**: a simulator trace (contract JSON lines, .gz) replayed with ``--speed max``
  — each line one message, sent byte for byte; timed until Kafka acknowledged all.
* **exporter**: an NCCL Inspector dump directory (one file per rank, in the plugin's
  exact format) followed from scratch by :class:`producers.exporter.Exporter`, batching
  per communicator every ``--interval`` s; timed until every line is acknowledged
  and the positions are saved.
* **inspector parse** / **flight recorder parse**: the readers alone, no Kafka.

The broker is ``$KAFKA_BOOTSTRAP`` when set, else a local one started for the run
(``compose.local_broker.LocalKafka``)::

    python -m bench.bench_producers                      # 128 GPUs, 30 s simulated
    python -m bench.bench_producers --gpus 1024 --duration 20 --inspector-lines 400000

Prints one table row per stage: events, messages, seconds, events/s, messages/s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec

from c4base.kafka import KafkaConfig
from compose.local_broker import LocalKafka, create_topics
from producers.exporter import Exporter, ExporterConfig
from producers.formats.flight_recorder import read_flight_recorder
from producers.formats.inspector import read_inspector_file
from producers.replay import ReplayConfig, replay
from producers.simulator import SCENARIOS, with_gpus, write_trace

Row = tuple[str, int, int, float]


@contextlib.contextmanager
def broker() -> Iterator[str]:
    if os.environ.get("KAFKA_BOOTSTRAP"):
        yield os.environ["KAFKA_BOOTSTRAP"]
        return
    with LocalKafka(heap="1g") as kafka:
        yield kafka.bootstrap


def _topics(bootstrap: str, partitions: int) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    events, dead = f"bench.events.{tag}", f"bench.deadletter.{tag}"
    create_topics(bootstrap, {events: partitions, dead: 1})
    return events, dead


def bench_replay(bootstrap: str, tmp: Path, gpus: int, duration: float) -> Row:

    cfg = msgspec.structs.replace(
        with_gpus(SCENARIOS["healthy"], gpus), duration_s=duration, seed=0
    )
    trace = tmp / "sim.jsonl.gz"
    write_trace(cfg, trace, tmp / "truth.json")
    events_topic, dead_topic = _topics(bootstrap, 8)
    rc = ReplayConfig(
        kafka=KafkaConfig(bootstrap=bootstrap),
        events_topic=events_topic,
        deadletter_topic=dead_topic,
        speed=None,
        progress=False,
    )
    stats = replay([trace], rc)
    assert stats.ok, stats
    return (f"replay ({gpus} GPUs)", stats.events, stats.messages, stats.elapsed_s)


def _inspector_dir(tmp: Path, ranks: int, lines_per_rank: int) -> Path:
    """``ranks`` files of Inspector lines: a DP communicator over all ranks + TP per 8."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "c4_make_fixtures",
        Path(__file__).resolve().parents[1] / "tests" / "producers" / "data" / "make_fixtures.py",
    )
    assert spec is not None and spec.loader is not None
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    d = tmp / "nccl-inspector-bench"
    d.mkdir()
    t0 = 1_750_000_000_000_000
    for r in range(ranks):
        host = f"node-{r // 8:03d}"
        with open(d / f"{host}-pid{1000 + r}.log", "w") as fh:
            for sn in range(1, lines_per_rank // 2 + 1):
                ts = t0 + sn * 1000
                fh.write(
                    mk.inspector_line(
                        comm="0xd0", rank=r, n_ranks=ranks, nnodes=ranks // 8, host=host,
                        pid=1000 + r, ts_us=ts, coll="AllReduce", sn=sn, size=1 << 26,
                        exec_us=5000, algbw=100.0, busbw=180.0,
                    )
                )  # fmt: skip
                fh.write(
                    mk.inspector_line(
                        comm=f"0xt{r // 8}", rank=r % 8, n_ranks=8, nnodes=1, host=host,
                        pid=1000 + r, ts_us=ts + 10, coll="AllGather", sn=sn, size=1 << 24,
                        exec_us=800, algbw=300.0, busbw=260.0,
                    )
                )  # fmt: skip
    return d


def bench_exporter(bootstrap: str, tmp: Path, ranks: int, lines: int, interval: float) -> Row:
    d = _inspector_dir(tmp, ranks, max(2, lines // ranks))
    total = sum(1 for f in d.iterdir() for _ in open(f, "rb"))
    events_topic, dead_topic = _topics(bootstrap, 8)
    cfg = ExporterConfig(
        directory=d,
        kafka=KafkaConfig(bootstrap=bootstrap),
        events_topic=events_topic,
        deadletter_topic=dead_topic,
        interval_s=interval,
        state_file=tmp / "positions.json",
    )
    ex = Exporter(cfg)
    t0 = time.perf_counter()
    while ex.stats.events < total:
        ex.poll_once()
    ex.close()
    dt = time.perf_counter() - t0
    assert ex.stats.delivered == ex.stats.messages and ex.stats.deadletters == 0
    return (f"exporter ({ranks} files)", ex.stats.events, ex.stats.messages, dt)


def bench_readers(tmp: Path) -> list[Row]:
    d = tmp / "nccl-inspector-bench"
    t0 = time.perf_counter()
    n = sum(1 for f in sorted(d.iterdir()) for _ in read_inspector_file(f, job="b"))
    rows: list[Row] = [("inspector parse", n, 0, time.perf_counter() - t0)]
    # Flight Recorder: a 2000-entry ring buffer (PyTorch's default size), 8 ranks.
    spec_path = Path(__file__).resolve().parents[1] / "tests" / "producers" / "data"
    import importlib.util

    spec = importlib.util.spec_from_file_location("c4_mk2", spec_path / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    mk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mk)
    fr = tmp / "fr"
    fr.mkdir()
    for rank in range(8):
        entries = [mk._entry(i, 0, mk.PG0, i + 1, "completed", rank % 4) for i in range(2000)]
        dump = {
            "version": "2.4",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(8)))}},
            "pg_status": {"0": {"last_enqueued_collective": 2000, "last_started_collective": 2000,
                                "last_completed_collective": 2000}},
            "entries": entries,
        }  # fmt: skip
        (fr / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    t0 = time.perf_counter()
    n = sum(len(read_flight_recorder(f, job="b")) for f in sorted(fr.iterdir()))
    rows.append(("flight recorder parse", n, 0, time.perf_counter() - t0))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gpus", type=int, default=128, help="simulated job size for replay")
    ap.add_argument("--duration", type=float, default=30.0, help="simulated seconds for replay")
    ap.add_argument("--ranks", type=int, default=64, help="Inspector files for the exporter")
    ap.add_argument("--inspector-lines", type=int, default=200_000, help="lines in all files")
    ap.add_argument("--interval", type=float, default=1.0, help="exporter batch interval (s)")
    args = ap.parse_args(argv)
    rows: list[Row] = []
    with broker() as bootstrap, tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        print(f"broker {bootstrap}")
        rows.append(bench_replay(bootstrap, tmp, args.gpus, args.duration))
        rows.append(bench_exporter(bootstrap, tmp, args.ranks, args.inspector_lines, args.interval))
        rows.extend(bench_readers(tmp))
    head = ("stage", "events", "messages", "seconds", "events/s", "msgs/s")
    print("{:<24} {:>10} {:>9} {:>8} {:>10} {:>8}".format(*head))
    for stage, events, messages, dt in rows:
        mps = f"{messages / dt:>8,.0f}" if messages else f"{'-':>8}"
        print(f"{stage:<24} {events:>10,} {messages:>9,} {dt:>8.2f} {events / dt:>10,.0f} {mps}")


if __name__ == "__main__":
    main()
