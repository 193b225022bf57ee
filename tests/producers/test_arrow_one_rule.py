"""One validation for both wire formats (issue 25): whatever the JSON decoder refuses by
the contract's bounds, the Arrow decoder refuses too, and an Arrow message that would
decompress beyond the limit is refused before anything is decompressed."""

from __future__ import annotations

import json
import resource

import msgspec
import pyarrow as pa
import pytest

from producers.columnar import MAX_DECODED_BYTES, decode_arrow, encode_arrow, events_table
from producers.events import (
    EventDecodeError,
    OpEvent,
    ProgressEvent,
    decode_message,
    encode_message,
)

GOOD = OpEvent(v=1, job="j", comm="0xa", nranks=2, rank=0, host="node-1", ts_us=1, op="AllReduce",
               seq=1, bytes=8, exec_us=10.0)  # fmt: skip
HB = ProgressEvent(v=1, job="j", comm="0xa", nranks=2, rank=0, host="node-1", ts_us=1,
                   started=1, completed=1)  # fmt: skip

BAD = {
    "host with NUL": dict(host="node\x001"),
    "host right-to-left": dict(host="node-\u202e1"),
    "host Cyrillic": dict(host="n\u043ede-1"),
    "host 254 characters": dict(host="a" * 254),
    "algbw inf": dict(algbw_gbs=float("inf")),
    "algbw 1e300": dict(algbw_gbs=1e300),
    "algbw negative": dict(algbw_gbs=-1.0),
    "busbw NaN": dict(busbw_gbs=float("nan")),
    "exec_us 1e300": dict(exec_us=1e300),
    "comm_name 257 characters": dict(comm_name="x" * 257),
    "comm 257 characters": dict(comm="c" * 257),
    "job 300 characters (multi-byte)": dict(job="é" * 300),
    "nranks over the ceiling": dict(nranks=2**21),
    "op 257 characters": dict(op="A" * 257),
}


@pytest.mark.parametrize("change", BAD.values(), ids=BAD.keys())
def test_arrow_refuses_what_json_refuses(change: dict) -> None:
    ev = msgspec.structs.replace(GOOD, **change)
    with pytest.raises(EventDecodeError):  # (json writes inf and NaN as its own words)
        decode_message(json.dumps([{"kind": "op", **msgspec.to_builtins(ev)}]).encode())
    with pytest.raises(EventDecodeError):
        decode_arrow(encode_arrow([ev]))


def test_in_flight_time_beyond_the_bound_is_refused_both_ways() -> None:
    ev = msgspec.structs.replace(HB, inflight_op="AllReduce", inflight_us=1e300)
    with pytest.raises(EventDecodeError):
        decode_message(encode_message([ev]))
    with pytest.raises(EventDecodeError, match="inflight_us"):
        decode_arrow(encode_arrow([ev]))


def test_what_json_accepts_arrow_accepts() -> None:
    evs = [msgspec.structs.replace(GOOD, comm_name="é" * 256, host="a" * 63 + ".b",
                                   algbw_gbs=1e15, job="j" * 256), HB]  # fmt: skip
    assert decode_message(encode_message(evs)) == evs
    assert [c.n for c in decode_arrow(encode_arrow(evs))] == [2]


def _compressed(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, table.schema, options=opts) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def test_a_huge_string_in_a_small_compressed_message_is_refused_undecompressed() -> None:
    """The issue's 400 MB ``comm_name`` in a 17 KB message: refused from the metadata,
    with no growth of the process's peak memory near the string's size."""
    t = events_table([GOOD])
    row = t.to_pylist()[0]
    row["comm_name"] = "x" * (400 << 20)
    data = _compressed(pa.Table.from_pylist([row], schema=t.schema))
    del row
    assert len(data) < 100_000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with pytest.raises(EventDecodeError, match=f"limit {MAX_DECODED_BYTES}"):
        decode_arrow(data)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 100 * 1024, f"peak RSS grew by {grown} KiB"


def test_a_compressed_message_within_the_limit_decodes() -> None:
    data = _compressed(events_table([GOOD, msgspec.structs.replace(GOOD, rank=1)]))
    (cols,) = decode_arrow(data)
    assert cols.n == 2
