"""The exporter applies the worker's edge limits and signs what it publishes (issue 12,
parts 1 and 5), against the real broker: a bad local record is counted, logged once per
kind, dead-lettered and never published; the rest goes on, signed by this host."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import pytest

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.signing import (
    HOST_HEADER,
    SIG_HEADER,
    KeyFileError,
    event_bytes,
    generate_key_file,
    header,
    host_key,
    load_key,
    parse_fresh,
    verify,
    write_key_file,
)
from producers.events import decode_message
from producers.exporter import Exporter, ExporterConfig
from tests.kafka_helpers import consume

_spec = importlib.util.spec_from_file_location(
    "c4_make_fixtures", Path(__file__).parent / "data" / "make_fixtures.py"
)
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

NOW_US = time.time_ns() // 1000


def line(sn: int, *, host: str = "node-001", rank: int = 0, n_ranks: int = 4,
         ts_us: int | None = None, exec_us: int = 500) -> bytes:  # fmt: skip
    return _fixtures.inspector_line(
        comm="0xaaaa", rank=rank, n_ranks=n_ranks, nnodes=2, host=host, pid=100,
        ts_us=NOW_US + sn * 1000 if ts_us is None else ts_us, coll="AllReduce", sn=sn,
        size=1 << 20, exec_us=exec_us, algbw=10.0, busbw=15.0,
    ).encode() + b"\n"  # fmt: skip


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_bad_records_are_refused_and_the_rest_is_signed(
    tmp_path: Path, kafka_bootstrap: str, make_topics, caplog: pytest.LogCaptureFixture
) -> None:
    topics = make_topics({"events": 1, "deadletter": 1})
    master = generate_key_file(tmp_path / "master.key")
    key = host_key(load_key(master), "node-001")
    key_file = write_key_file(tmp_path / "node-001.key", key)
    d = tmp_path / "nccl-inspector-9"
    d.mkdir()
    bad = {
        2: (line(2, host="node-002"), "event of host 'node-002', this exporter is 'node-001'"),
        3: (line(3, host="node-003"), "event of host 'node-003'"),
        4: (line(4, n_ranks=100_000), "nranks 100000 is over the limit of 65536"),
        5: (line(5, n_ranks=2**31), "breaks the contract: Expected `int` <= 1048576"),
        6: (line(6, ts_us=NOW_US + 365 * 86_400 * 10**6), "s ahead of the wall clock"),
        7: (line(7, ts_us=-1), "breaks the contract: Expected `int` >= 0 - at `$.ts_us`"),
        8: (line(8, exec_us=10**16), "Expected `float` <= 1000000000000000.0 - at `$.exec_us`"),
    }
    good = [line(1), line(9), line(10)]
    (d / "node-001-pid100.log").write_bytes(
        good[0] + b"".join(b for b, _ in bad.values()) + b"".join(good[1:])
    )
    cfg = ExporterConfig(
        directory=d,
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        events_topic=topics["events"],
        deadletter_topic=topics["deadletter"],
        host="node-001",
        signing_key_file=key_file,
        flush_timeout_s=15.0,
    )
    ex = Exporter(cfg)
    with caplog.at_level(logging.WARNING, logger="producers.exporter.core"):
        ex.poll_once(publish=True)
        ex.close()
    assert (ex.stats.events, ex.stats.refused, ex.stats.deadletters) == (3, 7, 7)
    refusals = [r for r in caplog.records if "refused a record" in r.getMessage()]
    assert len(refusals) == 4  # once per kind: two foreign hosts, three contract breaches

    (msg,) = consume(kafka_bootstrap, topics["events"], expect=1)
    assert [e.seq for e in decode_message(msg.value())] == [1, 9, 10]
    hs = msg.headers()
    assert header(hs, HOST_HEADER) == b"node-001"
    fresh = header(hs, "c4-fresh")  # the exporter's sequence number and time, signed too
    assert fresh is not None and parse_fresh(fresh) is not None
    signed = event_bytes(msg.value(), "node-001", None, fresh)
    assert verify([key], signed, header(hs, SIG_HEADER))
    dls = [DeadLetter.decode(m.value()) for m in consume(kafka_bootstrap, topics["deadletter"], 7)]
    assert len(dls) == 7
    for dl, (raw, why) in zip(dls, bad.values(), strict=True):
        assert dl.stage == "exporter" and dl.payload() == raw.rstrip(b"\n")
        assert dl.reason.startswith("refused at the exporter: ") and why in dl.reason


def test_signing_needs_a_host_and_a_usable_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="signing_key_file needs host"):
        ExporterConfig(directory=tmp_path, signing_key_file=tmp_path / "k")
    with pytest.raises(KeyFileError, match="does not exist"):
        ExporterConfig(directory=tmp_path, host="node-1", signing_key_file=tmp_path / "k")
    with pytest.raises(ValueError, match="not an RFC 1123 name"):
        ExporterConfig(directory=tmp_path, host="--all")
