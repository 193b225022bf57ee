"""State through the real broker (issue 12, defects 1 and 3).

* A malicious pickle (loading it would create a marker file) is written to every topic
  the worker reads: ``c4.events``, ``c4.verdicts``, its watermark topic and both table
  changelogs, raw and wrapped in every framing the worker itself writes. Nothing runs,
  and the fault in the trace is still found.
* A 16,384-rank communicator's checkpoint (~6 MB of state, the broker takes 1 MB per
  message) goes through the changelog in compressed chunks and is restored.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from producers.events import OpEvent, ProgressEvent, encode_message
from streams.app.checkpoint import join_checkpoint, split_checkpoint
from streams.app.correlate_runner import CorrelatorRunner
from streams.app.detect_runner import unwrap_state, wrap_state
from streams.app.topics_admin import ensure_topics
from streams.worker import start_worker_process
from tests.chaos.harness import (
    ROWS,
    Row,
    as_messages,
    commands,
    judge,
    produce,
    read_records,
    trace,
    worker_config,
)
from tests.chaos.test_fuzz import Boom

pytestmark = pytest.mark.kafka


@pytest.mark.timeout(240)
def test_a_malicious_pickle_on_every_topic_the_worker_reads_runs_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    good = trace()
    marker = tmp_path / "PWNED"
    evil = pickle.dumps(Boom(marker), protocol=5)
    comms = sorted({b[0].comm for b in good})
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    topics = cfg.topics()
    ensure_topics(cfg)
    # Changelogs first: the worker restores tables from them when it starts.
    comm_records: list[tuple[bytes | None, bytes]] = []
    for i, comm in enumerate(comms):
        key = comm.encode()
        framings = [
            evil,  # raw
            *(v for _, v in split_checkpoint(key, evil, chunk_bytes=1 << 20, gen=1)),
            *(
                v for _, v in split_checkpoint(key, wrap_state(8, evil), chunk_bytes=1 << 20, gen=2)
            ),  # fmt: skip
        ]
        comm_records.append((key, framings[i % len(framings)]))
    # The last record per key wins: every communicator's checkpoint is an evil one.
    produce(kafka_bootstrap, cfg.comm_table_changelog(), comm_records)
    ckey = CorrelatorRunner.key(0)
    produce(
        kafka_bootstrap,
        cfg.correlator_table_changelog(),
        [(ckey, evil), *split_checkpoint(ckey, evil, chunk_bytes=1 << 20, gen=3)],
    )
    on_inputs = [
        (topics.events, [(comms[0].encode(), evil)] * 5),
        (topics.verdicts, [(b"node-000", evil)] * 5),
        (cfg.watermark_topic(), [(b"0", evil)] * 5),
    ]
    sent = len(comm_records) + 2 + 15
    with start_worker_process(cfg) as w:
        w.wait_ready(90)
        for topic, msgs in on_inputs:
            produce(kafka_bootstrap, topic, msgs)
        produce(kafka_bootstrap, topics.events, as_messages(good))
        w.wait_for(lambda s: s["detect"]["events"] >= sum(map(len, good)), 120, "through the trace")
        cmds = commands(kafka_bootstrap, topics.isolations, want=1, timeout=30)
        st = w.status()
        assert w.stop() == 0
    judged = judge(cmds)
    ROWS.append(
        Row(
            "malicious pickle on all 5 topics the worker reads",
            sent=sent + len(good),
            deadlettered=st["deadletters_sent"],
            found="1/1" if judged.found else "0/1",
            false_isolations=judged.false_isolations,
            duplicated=judged.duplicated,
            notes="code ran: " + ("YES" if marker.exists() else "no"),
        )
    )
    assert not marker.exists()
    assert st["detect"]["restored"] == 0  # every evil checkpoint refused, started afresh
    # events, verdicts and watermarks: 15 dead letters; each refused checkpoint (one per
    # communicator, one correlator) may be dead-lettered too
    assert 15 <= st["deadletters_sent"] <= 15 + len(comms) + 1
    assert judged.found and judged.false_isolations == 0


N = 16_384
T0 = 1_750_000_000_000_000


def big_comm_messages(rounds: int, per_msg: int = 2048) -> list[tuple[bytes | None, bytes]]:
    out: list[tuple[bytes | None, bytes]] = []
    for seq in range(rounds):
        for lo in range(0, N, per_msg):
            evs: list = [
                OpEvent(v=1, job="big", comm="0xbig", nranks=N, rank=r,
                        host=f"node-{r // 8:04d}", gpu=r % 8, ts_us=T0 + seq * 200_000 + r,
                        op="AllReduce", seq=seq, bytes=1 << 20,
                        exec_us=1000.0 + (r * 7919 + seq) % 97)
                for r in range(lo, min(N, lo + per_msg))
            ]  # fmt: skip
            evs += [
                ProgressEvent(v=1, job="big", comm="0xbig", nranks=N, rank=r,
                              host=f"node-{r // 8:04d}", gpu=r % 8,
                              ts_us=T0 + seq * 200_000 + 100_000, started=seq + 1,
                              completed=seq + 1)
                for r in range(lo, min(N, lo + per_msg))
            ]  # fmt: skip
            out.append((b"0xbig", encode_message(evs)))
    return out


@pytest.mark.timeout(300)
def test_a_16k_rank_checkpoint_goes_through_the_broker_and_comes_back(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    cfg = worker_config(
        kafka_bootstrap,
        tmp_path / "w",
        events_partitions=1,
        max_checkpoint_chunk_bytes=64 * 1024,
        checkpoint_every_s=1.0,
    )
    msgs = big_comm_messages(3)
    assert max(len(v) for _, v in msgs) < 1_000_000  # each under the broker's default
    with start_worker_process(cfg) as w:
        w.wait_ready(90)
        produce(kafka_bootstrap, cfg.topics().events, msgs)
        st1 = w.wait_for(lambda s: s["detect"]["events"] >= 6 * N, 180, "through 16k ranks")
        assert w.stop() == 0  # the clean stop checkpoints
    records = read_records(kafka_bootstrap, cfg.comm_table_changelog())
    largest = max(len(v or b"") for v in records.values())
    state = join_checkpoint(records.get, b"0xbig")
    assert state is not None
    size, detector_bytes = unwrap_state(state)
    assert size == N and len(detector_bytes) > 1_000_000  # more than one Kafka message
    chunks = sum(1 for k in records if k.startswith(b"0xbig\x00") and records[k])

    with start_worker_process(cfg) as w2:
        w2.wait_ready(90)
        produce(kafka_bootstrap, cfg.topics().events, big_comm_messages(4)[-8:])
        st2 = w2.wait_for(lambda s: s["detect"]["events"] >= 8 * 2048 * 2, 120, "fed")
        assert w2.stop() == 0
    ROWS.append(
        Row(
            "16,384-rank communicator checkpoint through the broker",
            sent=len(msgs) + 8,
            deadlettered=st1["deadletters_sent"] + st2["deadletters_sent"],
            notes=(
                f"state {len(detector_bytes) / 1e6:.1f} MB -> {chunks} chunks, largest "
                f"record {largest / 1e3:.0f} KB; restored: {st2['detect']['restored']}"
            ),
        )
    )
    assert st2["detect"]["restored"] == 1 and st2["detect"]["created"] == 0
    assert largest <= 64 * 1024 + 64
