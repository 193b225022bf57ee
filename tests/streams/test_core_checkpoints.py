"""Checkpoints are versioned msgpack with an explicit schema: nothing read back can run
code. A forged pickle, truncated or foreign bytes are refused (CheckpointError); the
worker dead-letters them and starts that state afresh."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import msgspec
import pytest

from producers.events import encode_message
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.app.correlate_runner import CorrelatorRunner
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter
from streams.app.engine import CoreEngine
from streams.core import (
    CommDetector,
    DetectConfig,
    DetectionPipeline,
    HostCorrelator,
    PolicyConfig,
)
from streams.core import checkpoint as ck
from streams.core.comm import _SCHEMA as COMM_SCHEMA
from streams.core.comm import _CommState
from streams.verdicts import Verdict, encode_verdict

R = msgspec.structs.replace


class _Evil:
    """Unpickling this runs ``os.system`` (what a writer of the changelog topic could do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.path}",))


def forged(path: Path) -> bytes:
    return pickle.dumps({"state": _Evil(path)}, protocol=5)


@pytest.fixture(scope="module")
def detectors() -> dict[str, CommDetector]:
    cfg = msgspec.structs.replace(
        SCENARIOS["healthy"], hosts=4, duration_s=12,
        faults=[FaultSpec(kind="straggler", host=1, gpu=2, start_s=0, severity=1.3)],
    )  # fmt: skip
    pipe = DetectionPipeline()
    for b in simulate(cfg):
        pipe.feed(b)
    pipe.finish()
    return pipe.detectors


def test_a_forged_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = forged(marker)
    with pytest.raises(ck.CheckpointError, match="not a c4stream checkpoint"):
        CommDetector.from_bytes(data, DetectConfig())
    with pytest.raises(ck.CheckpointError):
        HostCorrelator.from_bytes(data, PolicyConfig())
    assert not marker.exists()


def test_corrupt_foreign_and_newer_checkpoints_are_refused(
    detectors: dict[str, CommDetector],
) -> None:
    good = next(iter(detectors.values())).to_bytes()
    cor = HostCorrelator(PolicyConfig()).to_bytes()
    for bad, why in [
        (good[: len(good) // 2], "corrupt"),
        (cor, "'correlator' checkpoint where a 'comm' one"),
        (ck.encode("comm", 99, ck.Array("int8", [0], b"")), "newer"),
        (ck.MAGIC + b"\xc1", "corrupt checkpoint header"),
    ]:
        with pytest.raises(ck.CheckpointError, match=why):
            CommDetector.from_bytes(bad, DetectConfig())


def test_arrays_cannot_lie_about_their_size() -> None:
    with pytest.raises(ck.CheckpointError, match="does not match"):
        ck.unpack(ck.Array("int64", [1 << 40], b"\x00" * 8))
    with pytest.raises(ck.CheckpointError, match="not allowed"):
        ck.unpack(ck.Array("object", [1], b"\x00" * 8))


def test_an_older_schema_is_migrated() -> None:
    class V2(msgspec.Struct, array_like=True):
        ranks: int
        name: str

    old = ck.encode("demo", 1, msgspec.defstruct("V1", [("ranks", int)], array_like=True)(7))
    got = ck.decode(old, "demo", {2: V2}, {1: lambda b: [*b, "migrated"]})
    assert got == V2(7, "migrated")
    with pytest.raises(ck.CheckpointError, match="no migration"):
        ck.decode(old, "demo", {2: V2})


def test_round_trip_restores_every_detector_and_the_same_bytes(
    detectors: dict[str, CommDetector],
) -> None:
    for d in detectors.values():
        data = d.to_bytes()
        back = CommDetector.from_bytes(data, DetectConfig())
        assert back.to_bytes() == data
        assert [x.name for x in back.detectors] == ["hang", "straggler", "slow_conn"]


def test_router_dead_letters_a_forged_checkpoint_and_starts_afresh(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = forged(marker)
    r = CommRouter(CoreEngine(), lambda key: data, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=250_000)  # fmt: skip
    batch = next(b for b in simulate(SCENARIOS["healthy"]) if b)
    out = r.process([Record("ev", 0, 1, batch[0].comm.encode(), encode_message(batch))])
    [dl] = out.deadletters
    assert dl.source == f"checkpoint:{batch[0].comm}" and dl.payload() == data
    assert dl.reason.startswith("checkpoint refused, state starts afresh: not a c4stream")
    assert r.stats.created == 1 and r.stats.restored == 0
    assert not marker.exists()

    runner = CorrelatorRunner(CoreEngine(), lambda key: data, checkpoint_every_events=10**9,
                              checkpoint_every_s=1e9, watermark_topic="wm")  # fmt: skip
    verdict = Verdict(id="x", ts_us=1, job="j", comm="c", host="h", fault="straggler",
                      score=0.5, reason="r", window_start_us=0, window_end_us=1)  # fmt: skip
    out2 = runner.process([Record("v", 0, 1, None, encode_verdict(verdict), 1)])
    # the verdicts handed off by the partition's last owner, the partition's record of
    # the form before, then the job's own: all refused
    job_key = runner.key(0, "j").decode()
    assert [d.source for d in out2.deadletters] == [
        "checkpoint:held-verdicts-0",
        "checkpoint:correlator-0",
        f"checkpoint:{job_key}",
    ]
    assert not marker.exists()


def test_bad_state_inside_a_well_formed_checkpoint_is_refused(
    detectors: dict[str, CommDetector],
) -> None:
    good = next(iter(detectors.values())).to_bytes()
    st = ck.decode(good, "comm", {COMM_SCHEMA: _CommState})
    for bad, why in [
        (R(st, model=R(st.model, op50=b"\x00" * 170)), "quantile state"),
        (R(st, model=R(st.model, op90=b"junk")), "quantile state"),
        (R(st, ranks=R(st.ranks, hosts=[])), "host_idx is not in its list"),
    ]:
        with pytest.raises(ck.CheckpointError, match=why):
            CommDetector.from_bytes(ck.encode("comm", COMM_SCHEMA, bad), DetectConfig())


def _as_schema_1(data: bytes, kind: str, drop: int) -> bytes:
    """A schema-2 checkpoint written back as schema 1 would have been: the fields that
    schema 2 added (the last ``drop``) left out."""
    body = msgspec.msgpack.decode(data[4:])[2]
    return ck.MAGIC + msgspec.msgpack.encode([kind, 1, body[:-drop]])


def test_schema_1_checkpoints_of_this_release_are_migrated(
    detectors: dict[str, CommDetector],
) -> None:
    """Comm, straggler, slow-connection and correlator checkpoints of schema 1 load (the
    fields schema 2 added start afresh) and the communicator goes on judging."""
    from streams.core.correlate_state import SCHEMA as COR_SCHEMA
    from streams.core.slow_conn import SlowConnDetector
    from streams.core.straggler import StragglerDetector

    assert COMM_SCHEMA == 2 and COR_SCHEMA == 3
    d = next(iter(detectors.values()))
    old = _as_schema_1(d.to_bytes(), "comm", 4)
    back = CommDetector.from_bytes(old, DetectConfig())
    assert back.view.p2p is None and back.n_events == d.n_events
    for det in back.detectors:
        if isinstance(det, StragglerDetector):
            st = msgspec.msgpack.decode(det.dump()[4:])[2]
            st[0] = st[0][:-3]  # the aligner without its squared waits (and seq span)
            v1 = ck.MAGIC + msgspec.msgpack.encode(["straggler", 1, st[:-1]])
            again = StragglerDetector.load(v1, DetectConfig())
            assert again.aligner.window_n_seqs == 0 and not again.long.any()
        if isinstance(det, SlowConnDetector):
            # schema 3 added the window's parts (4 fields) after schema 2's two
            again2 = SlowConnDetector.load(_as_schema_1(det.dump(), "slow_conn", 6), DetectConfig())
            assert again2.conn_n == 0
            body = msgspec.msgpack.decode(det.dump()[4:])[2][:-4]
            v2 = SlowConnDetector.load(ck.MAGIC + msgspec.msgpack.encode(["slow_conn", 2, body]),
                                       DetectConfig())  # fmt: skip
            assert v2.conn_n == det.conn_n and v2.matrix.shift == 0  # one part: its mean
    c = HostCorrelator(PolicyConfig())
    old_c = _as_schema_1(c.to_bytes(), "correlator", 3)  # schema 3's job field too
    assert HostCorrelator.from_bytes(old_c, PolicyConfig()).families.pairs == {}
