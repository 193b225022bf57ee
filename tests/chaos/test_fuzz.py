"""The fuzz corpus (issue 12, defects 2 and 4): thousands of bad messages of every
category mixed into a faulty trace on ``c4.events``, through the real broker and
worker. The worker never crashes, dead-letters each bad message once with its reason,
judges every good event, finds the fault and isolates nothing else."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import msgspec
import pytest

from producers.events import Event, encode_message
from streams.worker import start_worker_process
from tests.chaos.harness import (
    ROWS,
    Row,
    as_messages,
    commands,
    deadletters,
    judge,
    produce,
    trace,
    worker_config,
)

pytestmark = pytest.mark.kafka

PER_KIND = 150


class Boom:
    """Unpickling this would create a marker file; nothing may unpickle it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[override]
        return (Path.touch, (self.marker,))


def bad_corpus(good: list[list[Event]], marker: Path) -> dict[str, list[bytes]]:
    """Category -> bad messages; each breaks exactly one rule of the edge."""
    year = 365 * 86_400 * 1_000_000
    real = good[:PER_KIND]

    def each(fn) -> list[bytes]:
        return [fn(i, real[i % len(real)]) for i in range(PER_KIND)]

    def rep(batch: list[Event], **kw: object) -> bytes:
        return encode_message([msgspec.structs.replace(e, **kw) for e in batch])

    big_op = "x" * 700_000
    return {
        "deep nesting": each(lambda i, b: b"[" * (3000 + i) + b"]" * (3000 + i)),
        "nested unknown field": each(
            lambda i, b: b'{"kind":"op","x":' + b"[" * 2000 + b"]" * 2000 + b"}"
        ),
        "malformed JSON": each(lambda i, b: encode_message(b)[: -1 - i % 7]),
        "not UTF-8": each(lambda i, b: b"\xff\xfe" + bytes([i % 256]) * 10),
        "empty": each(lambda i, b: b"" if i % 2 else b"[]"),
        "missing field": each(lambda i, b: b'{"kind":"op","v":1,"job":"j"}'),
        "nranks 2^31": each(lambda i, b: rep(b, nranks=2**31)),
        "nranks doubled": each(lambda i, b: rep(b, nranks=b[0].nranks * 2)),
        "rank >= nranks": each(lambda i, b: rep(b, rank=b[0].nranks + i)),
        "ts_us a year ahead": each(lambda i, b: rep(b, ts_us=b[0].ts_us + year)),
        "ts_us 10^30": each(
            lambda i, b: encode_message(b).replace(
                f'"ts_us":{b[0].ts_us}'.encode(), b'"ts_us":' + b"1" + b"0" * 30, 1
            )
        ),
        "negative number": each(
            lambda i, b: (
                encode_message(b).replace(b'"seq":', b'"seq":-1', 1)
                if b'"seq":' in encode_message(b)
                else encode_message(b).replace(b'"started":', b'"started":-1', 1)
            )
        ),
        "1e300 duration": each(
            lambda i, b: (
                b'{"kind":"op","v":1,"job":"j","comm":"0x1","nranks":2,"rank":0,'
                b'"host":"h","ts_us":1,"op":"AllReduce","seq":1,"bytes":8,"exec_us":1e300}'
            )
        ),
        "bad host name": each(
            lambda i, b: rep(b, host=["--all", "*", "../../etc", "a\nb", "h_1", "a b"][i % 6])
        ),
        "oversize event (700 KB)": [
            b'{"kind":"op","v":1,"job":"j","comm":"0xbig","nranks":4096,"rank":1,'
            b'"host":"h","ts_us":1,"op":"' + big_op.encode() + b'","seq":1,"bytes":8,'
            b'"exec_us":1.0}'
        ]
        * 10,
        "pickle": each(lambda i, b: pickle.dumps(Boom(marker))),
    }


@pytest.mark.timeout(300)
def test_fuzz_corpus_mixed_into_a_faulty_trace(kafka_bootstrap: str, tmp_path: Path) -> None:
    good = trace()
    marker = tmp_path / "PWNED"
    bad = bad_corpus(good, marker)
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    topics = cfg.topics()
    msgs = as_messages(good)
    # The bad ones come after every communicator has been seen (its size fixed), spread
    # through the rest of the trace, keyed like the real traffic.
    head, tail = msgs[:100], msgs[100:]
    mixed = list(head)
    flat = [(good[i % len(good)][0].comm.encode(), v) for vs in bad.values() for i, v in
            enumerate(vs)]  # fmt: skip
    step = max(1, len(flat) // len(tail))
    for i, m in enumerate(tail):
        mixed += flat[i * step : (i + 1) * step] + [m]
    mixed += flat[len(tail) * step :]
    n_bad = sum(map(len, bad.values()))
    with start_worker_process(cfg) as w:
        w.wait_ready(90)
        pid = w.proc.pid
        produce(kafka_bootstrap, topics.events, mixed)
        st = w.wait_for(lambda s: s["detect"]["messages"] >= len(mixed), 120, "through the corpus")
        dls = deadletters(kafka_bootstrap, topics.deadletter, want=n_bad, timeout=60)
        cmds = commands(kafka_bootstrap, topics.isolations, want=1, timeout=30)
        st = w.status()
        assert w.proc.poll() is None and w.proc.pid == pid, w.log_tail()
        assert w.stop() == 0
    judged = judge(cmds)
    good_events = sum(map(len, good))
    reasons = Counter(d.reason.split(":")[0] for d in dls)
    ROWS.append(
        Row(
            "fuzz corpus: 16 kinds of bad input in a rank-hang trace",
            sent=len(mixed),
            deadlettered=len(dls),
            lost=good_events - st["detect"]["events"],
            duplicated=judged.duplicated,
            found="1/1" if judged.found else "0/1",
            false_isolations=judged.false_isolations,
            notes=f"{n_bad} bad messages; worker never restarted",
        )
    )
    assert not marker.exists()
    assert len(dls) == n_bad, reasons
    assert all(d.reason and d.source.startswith(topics.events) for d in dls)
    assert all(len(d.encode()) < 200_000 for d in dls)  # truncated, under any broker limit
    assert any(d.truncated for d in dls)
    assert st["detect"]["events"] == good_events
    assert judged.found and judged.false_isolations == 0 and judged.duplicated == 0
