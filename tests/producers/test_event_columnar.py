"""The Arrow form of the event contract: same fields as the JSON Schema, same rules."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from producers.columnar import (
    ARROW_CONTENT_TYPE,
    CONN_TYPE,
    EVENT_SCHEMA,
    MAX_MESSAGE_BYTES,
    decode_arrow,
    decode_block,
    decode_events,
    encode_arrow,
    encode_batch,
    is_arrow,
)
from producers.events import EventDecodeError, OpEvent, decode_message, encode_message
from producers.simulator import SimConfig, simulate
from tests.producers.test_event_contract import GOOD, SCHEMA, VALIDATOR, _mutations, _op

HERE = Path(__file__).parent


def _rows(docs: list[dict[str, Any]]) -> pa.Table:
    """Documents as a table with the types pyarrow infers (columns: union of their keys)."""
    return pa.Table.from_struct_array(pa.array(docs))


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def test_arrow_schema_has_exactly_the_contract_fields() -> None:
    defs = SCHEMA["$defs"]
    fields = set(defs["identity"]["properties"]) | set(defs["op"]["properties"])
    fields |= set(defs["progress"]["properties"])
    assert set(EVENT_SCHEMA.names) == fields
    assert len(EVENT_SCHEMA.names) == len(fields)
    assert [f.name for f in CONN_TYPE] == list(defs["conn"]["properties"])
    # required identity fields are non-nullable columns; kind-specific ones nullable
    required = set(defs["identity"]["required"]) | {"kind"}
    for f in EVENT_SCHEMA:
        assert f.nullable == (f.name not in required), f.name


def test_good_events_round_trip_and_equal_the_json_decoding() -> None:
    data = encode_arrow(GOOD)
    assert decode_events(data, ARROW_CONTENT_TYPE) == decode_message(encode_message(GOOD))
    (cols,) = decode_arrow(data)
    assert cols.n == len(GOOD) and cols.comm == GOOD[0].comm
    assert cols.is_op.tolist() == [True, True, False, False]
    assert cols.int("gpu").tolist() == [3, -1, -1, -1]
    assert cols.float("exec_us").tolist()[:2] == [5123.5, 5123.5]


def test_a_simulated_trace_decodes_to_the_same_events_both_ways() -> None:
    cfg = SimConfig(hosts=2, gpus_per_host=4, tp=4, duration_s=3, seed=3)
    events = [e for batch in simulate(cfg) for e in batch]
    assert len(events) > 100
    for i in range(0, len(events), 97):
        chunk = events[i : i + 97]
        js = decode_events(encode_message(chunk), None)
        ar = decode_events(encode_arrow(chunk), ARROW_CONTENT_TYPE)
        assert ar == js == chunk


def _representable(doc: Any) -> bool:
    return isinstance(doc, dict)


@pytest.mark.parametrize(
    "doc",
    [d for _, d in _mutations() if _representable(d)],
    ids=[i for i, d in _mutations() if _representable(d)],
)
def test_what_the_schema_rejects_the_arrow_decoder_rejects(doc: dict[str, Any]) -> None:
    assert not VALIDATOR.is_valid(doc)
    # the mutated document as a one-row table with the types pyarrow infers for it
    data = _ipc(_rows([doc]))
    with pytest.raises(EventDecodeError) as err:
        decode_arrow(data)
    assert len(str(err.value)) > 10


def test_error_names_the_column_and_row() -> None:
    docs = [json.loads(encode_message(_op(seq=s))) for s in (1, 2, 3)]
    docs[2]["seq"] = -4
    with pytest.raises(EventDecodeError, match=r"row 2, column `seq`"):
        decode_arrow(_ipc(_rows(docs)))


def test_other_kinds_fields_are_ignored_as_in_json() -> None:
    # a progress row with a negative seq: JSON ignores a field its kind lacks; so do we
    prog = json.loads(encode_message(GOOD[2]))
    op = json.loads(encode_message(GOOD[0]))
    prog["seq"] = -1
    assert decode_message(json.dumps(prog)) == [GOOD[2]]
    assert decode_events(_ipc(_rows([op, prog])), None)[1] == GOOD[2]


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "not an Arrow IPC stream"),
        (b"\xff\xff\xff\xff\x10\x00\x00\x00garbage!garbage!", "not an Arrow IPC stream"),
        (b"x" * (MAX_MESSAGE_BYTES + 1), "limit"),
    ],
    ids=["empty", "garbage", "too-large"],
)
def test_malformed_streams_give_a_clear_error(data: bytes, match: str) -> None:
    with pytest.raises(EventDecodeError, match=match):
        decode_arrow(data)


def test_truncated_stream_is_refused() -> None:
    data = encode_arrow(GOOD)
    with pytest.raises(EventDecodeError):
        decode_arrow(data[: len(data) // 2])


def test_no_rows_is_refused_like_an_empty_json_array() -> None:
    with pytest.raises(EventDecodeError, match="empty"):
        decode_arrow(_ipc(EVENT_SCHEMA.empty_table()))


def test_crafted_offsets_are_refused_not_read_out_of_bounds() -> None:
    # a string column whose last offset is patched to point far past its data: the IPC
    # reader alone accepts it; the decoder validates every batch fully first
    doc = json.loads(encode_message(GOOD[0]))
    table = _rows([{**doc, "host": "a" * 77}, {**doc, "host": "b" * 99}])
    data = _ipc(table)
    offsets = struct.pack("<3i", 0, 77, 176)
    assert data.count(offsets) == 1
    crafted = data.replace(offsets, struct.pack("<3i", 0, 77, 1 << 20))
    with pytest.raises(EventDecodeError, match="not an Arrow IPC stream"):
        decode_arrow(crafted)


def test_several_communicators_split_in_order_of_first_appearance() -> None:
    a1, b1, a2 = _op(comm="0xb", seq=1), _op(comm="0xa", seq=1), _op(comm="0xb", seq=2)
    parts = decode_arrow(encode_arrow([a1, b1, a2]))
    assert [(p.comm, p.int("seq").tolist()) for p in parts] == [("0xb", [1, 2]), ("0xa", [1])]
    assert decode_events(encode_arrow([a1, b1, a2]), None) == [a1, b1, a2]


def test_narrower_and_wider_types_are_accepted_when_values_fit() -> None:
    doc = json.loads(encode_message(_op(conns=None)))
    t = _rows([doc])  # ints inferred as int64, exec_us double
    t = t.set_column(t.schema.get_field_index("rank"), "rank", pa.array([2], pa.int8()))
    t = t.set_column(
        t.schema.get_field_index("host"), "host", pa.array(["node-07"]).dictionary_encode()
    )
    assert decode_events(_ipc(t), None) == [_op(conns=None)]
    too_big = t.set_column(t.schema.get_field_index("rank"), "rank", pa.array([1 << 40]))
    with pytest.raises(EventDecodeError, match="rank"):
        decode_arrow(_ipc(too_big))


def test_content_type_decides_and_unknown_types_are_refused() -> None:
    js = encode_message(GOOD)
    ar = encode_arrow(GOOD)
    assert not is_arrow(b"application/json", js) and is_arrow(ARROW_CONTENT_TYPE.encode(), ar)
    assert is_arrow(None, ar) and not is_arrow(None, js)  # headers dropped on the way
    with pytest.raises(EventDecodeError, match="unsupported content-type"):
        decode_events(js, b"text/csv")
    value, headers = encode_batch(GOOD, "arrow")
    assert headers == [("content-type", ARROW_CONTENT_TYPE.encode())] and value == ar
    with pytest.raises(ValueError, match="unknown wire format"):
        encode_batch(GOOD, "xml")


def test_one_batch_of_json_and_arrow_decodes_into_one_block() -> None:
    """decode_block, the worker's decoder: JSON and Arrow messages of a batch come out as
    rows of one block, each message's rows and each error as the message alone gives."""
    a1, b1, a2 = _op(comm="0xb", seq=1), _op(comm="0xa", seq=1), _op(comm="0xb", seq=2)
    good = [encode_arrow([e]) for e in GOOD] + [encode_arrow(GOOD), encode_arrow([a1, b1, a2])]
    bad_v = _ipc(_rows([{**json.loads(encode_message(GOOD[0])), "v": 2}]))
    foreign = _ipc(_rows([json.loads(encode_message(GOOD[1]))]))  # inferred, other types
    msgs: list[tuple[bytes, Any]] = [(m, ARROW_CONTENT_TYPE) for m in good]
    msgs += [(bad_v, ARROW_CONTENT_TYPE), (encode_message(GOOD), None), (b"[]", None)]
    msgs += [(good[0][:20], ARROW_CONTENT_TYPE), (foreign, None), (b'[{"kind":"op"}]', None)]
    msgs += [(encode_message([a1, b1, a2]), None)]

    def one(data: bytes, ct: Any) -> Any:
        try:
            return decode_events(data, ct)
        except EventDecodeError as err:
            return str(err)

    for batch in (msgs, [(m, None) for m in good], [m for m in msgs if m[1] is None]):
        items, block = decode_block(batch)
        got = []
        for x in items:
            if isinstance(x, int):
                assert block is not None
                parts = block.message_columns(x)
                assert all(len({e.comm for e in p.to_events()}) == 1 for p in parts)
                assert [p.int("seq").tolist() for p in parts] == [
                    [e.seq if isinstance(e, OpEvent) else -1 for e in p.to_events()] for p in parts
                ]
                got.append(sorted(encode_message(e) for p in parts for e in p.to_events()))
            else:
                got.append(str(x) if isinstance(x, EventDecodeError) else x)
        want = [one(*m) for m in batch]
        assert got == [x if isinstance(x, str) or not x else sorted(map(encode_message, x))
                       for x in want]  # fmt: skip
    assert sum(isinstance(x, EventDecodeError) for x in decode_block(msgs)[0]) == 3
