"""NCCL Inspector reader on files in the plugin's exact output format (tests/producers/data)."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest

from producers.events import OpEvent, decode_message, encode_message
from producers.formats.inspector import InspectorError, parse_inspector_line, read_inspector_file
from producers.traces import BadLine

DATA = Path(__file__).parent / "data" / "inspector" / "nccl-inspector-4242"
COMM_A = "0x7f8c496ae9f661"
COMM_B = "0xe62dedaa97644a"


def _read(path: Path, job: str = "j") -> tuple[list[tuple[int, OpEvent]], list[BadLine]]:
    bad: list[BadLine] = []
    return list(read_inspector_file(path, job=job, on_bad=bad.append)), bad


@pytest.mark.timeout(10)
def test_every_field_maps_as_documented() -> None:
    got, bad = _read(DATA / "node-001-pid1002.log")
    assert not bad
    assert [ln for ln, _ in got] == list(range(1, 11))
    first = got[0][1]
    assert first == OpEvent(
        v=1, job="j", comm=COMM_A, nranks=4, rank=1, host="node-001",
        ts_us=1_750_000_001_000_037, op="AllReduce", seq=1, bytes=17179869184,
        exec_us=62075.0, algbw_gbs=277.210914, busbw_gbs=485.119099,
    )  # fmt: skip
    # Both communicators of this process are there, each with its own rank and size.
    assert {(e.comm, e.nranks, e.rank) for _, e in got} == {(COMM_A, 4, 1), (COMM_B, 2, 1)}
    # A NaN bandwidth ("nan" as the plugin prints it) becomes absent, not NaN.
    third = [e for _, e in got if e.comm == COMM_A and e.seq == 3][0]
    assert third.algbw_gbs is None and third.busbw_gbs == pytest.approx(485.119099)
    # What comes out is valid contract data.
    assert decode_message(encode_message([e for _, e in got])) == [e for _, e in got]


@pytest.mark.timeout(10)
def test_verbose_dump_and_bad_line_reported_with_file_and_line() -> None:
    got, bad = _read(DATA / "node-002-pid2001.log")
    assert [e.seq for _, e in got] == [1, 2, 3, 4, 5]
    assert len(bad) == 1
    assert bad[0].lineno == 3 and bad[0].path.endswith("node-002-pid2001.log")
    assert "truncated" in bad[0].reason
    assert str(bad[0]).endswith("node-002-pid2001.log:3: Input data was truncated")


@pytest.mark.timeout(10)
def test_newer_version_unknown_fields_and_p2p_are_read() -> None:
    got, bad = _read(DATA / "node-002-pid2002.log")
    assert not bad
    newer = [e for _, e in got if e.op == "AllGather"][0]
    assert (newer.seq, newer.bytes, newer.exec_us) == (6, 1048576, 900.0)
    p2p = [e for _, e in got if e.op == "Send"][0]
    assert p2p.seq == 1 and p2p.bytes == 4194304 and p2p.conns is not None
    assert (p2p.conns[0].peer, p2p.conns[0].dir, p2p.conns[0].bytes) == (0, "send", 4194304)


@pytest.mark.timeout(10)
def test_partial_last_line_is_not_consumed(tmp_path: Path) -> None:
    src = (DATA / "node-001-pid1001.log").read_bytes()
    cut = src.rstrip(b"\n").rfind(b"\n") + 1 + 40  # 40 bytes into the last line
    path = tmp_path / "h-pid1.log"
    path.write_bytes(src[:cut])
    got, bad = _read(path)
    assert len(got) == 9 and not bad
    path.write_bytes(src)
    got, bad = _read(path)
    assert len(got) == 10 and not bad


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        (b"not json", "malformed"),
        (b'{"header":{"id":"0x1","rank":0,"n_ranks":2},"metadata":{"hostname":"h",'
         b'"dump_timestamp_us":1}}', "neither coll_perf nor p2p_perf"),
        (b'{"header":{"id":"0x1","rank":5,"n_ranks":2},"metadata":{"hostname":"h",'
         b'"dump_timestamp_us":1},"coll_perf":{"coll":"AllReduce","coll_sn":1,'
         b'"coll_msg_size_bytes":1,"coll_exec_time_us":1}}', "outside"),
        (b'{"header":{"id":"0x1","rank":0,"n_ranks":2},"metadata":{"hostname":"h",'
         b'"dump_timestamp_us":1},"coll_perf":{"coll":"AllReduce","coll_sn":-1,'
         b'"coll_msg_size_bytes":1,"coll_exec_time_us":1}}', r"Expected `int` >= 0"),
    ],
)  # fmt: skip
def test_bad_records_raise_with_reason(line: bytes, reason: str) -> None:
    with pytest.raises(InspectorError, match=reason):
        parse_inspector_line(line, job="j")


@pytest.mark.timeout(10)
def test_gzip_log_is_read(tmp_path: Path) -> None:
    import gzip

    path = tmp_path / "h-pid1.log.gz"
    with gzip.open(path, "wb") as fh:
        fh.write((DATA / "node-001-pid1001.log").read_bytes())
    got, bad = _read(path)
    assert len(got) == 10 and not bad
    shutil.rmtree(tmp_path)


DATA_230 = Path(__file__).parent / "data" / "inspector_2_30"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("sub", ["nccl-inspector-7311", "v4_2/nccl-inspector-7312"])
def test_nccl_2_30_layout_many_ops_per_communicator_per_dump(sub: str) -> None:
    """NCCL 2.30: each dump writes the ring of ops completed since the last dump, per
    communicator, with header.comm_name; v4.2 adds algo/proto and dump_stats records."""
    files = sorted((DATA_230 / sub).iterdir())
    events: list[OpEvent] = []
    for f in files:
        got, bad = _read(f)
        assert bad == []
        events += [e for _, e in got]
    # 4 processes; per dump 6 ops of the world communicator and 4 of the host's own.
    assert len(events) == 4 * 3 * (6 + 4)
    names = {e.comm: e.comm_name for e in events}
    assert names == {"0x5e7a1c9d22f04b": "dp_world", "0x91b2c3d4e5f601": "tp_node1",
                     "0x91b2c3d4e5f602": "tp_node2"}  # fmt: skip
    world0 = sorted(e.seq for e in events if e.comm == "0x5e7a1c9d22f04b" and e.rank == 0)
    assert world0 == list(range(1, 19))  # no gaps: every completed op is there
    dumps = {e.ts_us for e in events if e.comm == "0x5e7a1c9d22f04b" and e.rank == 0}
    assert len(dumps) == 3  # several ops share one dump time
    if sub.startswith("v4_2"):
        assert {(e.algo, e.proto) for e in events} == {("RING", "SIMPLE")}
    else:
        assert {(e.algo, e.proto) for e in events} == {(None, None)}


@pytest.mark.timeout(10)
def test_unknown_newer_layout_gives_one_message_per_file(tmp_path: Path) -> None:
    """A layout this reader does not know (header and metadata once per communicator in
    the dump_stats record, bare coll_perf lines after it): one clear message for the file."""
    src = sorted((DATA_230 / "v4_2" / "nccl-inspector-7312").iterdir())[0]
    out = []
    for raw in src.read_text().splitlines():
        rec = msgspec.json.decode(raw)
        rec["metadata"]["inspector_output_format_version"] = "v4.3"
        if "coll_perf" in rec:
            rec = {"coll_perf": rec["coll_perf"]}
        out.append(msgspec.json.encode(rec).decode())
    path = tmp_path / "gpu-node-01-pid41001.log"
    path.write_text("\n".join(out) + "\n")
    got, bad = _read(path)
    assert got == [] and len(bad) == 1
    assert "format v4.3 is newer" in bad[0].reason and "30 record(s)" in bad[0].reason
    # Within the known versions a broken line is still reported on its own line.
    path.write_text(src.read_text() + "{not json\n")
    got, bad = _read(path)
    assert len(got) == 30 and [b.lineno for b in bad] == [37]
