"""The event contract against its own schema: the schema file is the oracle."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from producers.events import (
    Conn,
    EventDecodeError,
    OpEvent,
    ProgressEvent,
    decode_message,
    encode_message,
)

SCHEMA_PATH = Path(__file__).parents[2] / "producers" / "contracts" / "collective-event.schema.json"
SHARED = Path(__file__).parents[3] / "shared" / "contracts" / "collective-event.schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def _op(**kw: Any) -> OpEvent:
    base: dict[str, Any] = dict(
        v=1,
        job="job-1",
        comm="0x1f",
        nranks=4,
        rank=2,
        host="node-07",
        gpu=3,
        nic="mlx5_3",
        ts_us=1_700_000_000_000_000,
        op="AllReduce",
        seq=41,
        bytes=1 << 26,
        exec_us=5123.5,
        algbw_gbs=12.1,
        busbw_gbs=18.2,
        algo="RING",
        proto="SIMPLE",
        conns=[
            Conn(peer=3, dir="send", bytes=1 << 25, time_us=2500.0, retrans=0),
            Conn(peer=1, dir="recv", bytes=1 << 25),
        ],
    )
    base.update(kw)
    return OpEvent(**base)


def _progress(**kw: Any) -> ProgressEvent:
    base: dict[str, Any] = dict(
        v=1,
        job="job-1",
        comm="0x1f",
        nranks=4,
        rank=0,
        host="node-01",
        ts_us=5,
        started=42,
        completed=41,
        inflight_op="AllReduce",
        inflight_us=1.5e6,
        conns=[Conn(peer=1, dir="send", bytes=10)],
    )
    base.update(kw)
    return ProgressEvent(**base)


GOOD = [
    _op(),
    _op(conns=None, gpu=None, nic=None, algbw_gbs=None, comm_name="DP group 3"),
    _progress(),
    _progress(inflight_op=None, inflight_us=None, conns=None),
]


# Kinds this project added to the shared contract as new, versioned, optional kinds
# (DESIGN: "extend a contract only by optional fields or a new, versioned optional kind");
# shared/contracts is read-only here, so the upstream copy gains them when it is next laid.
EXTENSION_KINDS = {"summary"}  # docs/summaries.md


def test_vendored_schema_matches_shared_contract() -> None:
    """The project's copy is the shared contract, extended only by new optional kinds."""
    if not SHARED.exists():
        pytest.skip("shared/contracts is not beside this checkout")
    shared = json.loads(SHARED.read_text())
    if shared == SCHEMA:
        return
    # Every shared definition unchanged; every shared branch still offered.
    for name, definition in shared["$defs"].items():
        assert SCHEMA["$defs"][name] == definition, f"$defs/{name} differs from shared/"
    assert set(SCHEMA["$defs"]) - set(shared["$defs"]) == EXTENSION_KINDS
    extra = {f"#/$defs/{k}" for k in EXTENSION_KINDS}

    def refs(branches: list[dict]) -> list[str]:
        return [b["$ref"] for b in branches if "$ref" in b]

    ours, theirs = SCHEMA["oneOf"], shared["oneOf"]
    assert set(refs(ours)) - set(refs(theirs)) == extra
    assert [b for b in ours if "$ref" not in b][0]["items"]["oneOf"] == [
        *[b for b in theirs if "$ref" not in b][0]["items"]["oneOf"],
        *({"$ref": r} for r in sorted(extra)),
    ]
    for key in set(shared) - {"oneOf", "$defs"}:
        assert SCHEMA[key] == shared[key]


@pytest.mark.parametrize("event", GOOD, ids=lambda e: type(e).__name__)
def test_encoded_single_event_validates(event: OpEvent | ProgressEvent) -> None:
    doc = json.loads(encode_message(event))
    VALIDATOR.validate(doc)
    assert decode_message(encode_message(event)) == [event]


def test_encoded_batch_validates_and_round_trips() -> None:
    data = encode_message(list(GOOD))
    VALIDATOR.validate(json.loads(data))
    assert decode_message(data) == GOOD
    # Encoding is deterministic: the same events give the same bytes.
    assert encode_message(decode_message(data)) == data


def test_unknown_fields_are_tolerated_as_the_schema_allows() -> None:
    doc = json.loads(encode_message(_op()))
    doc["future_field"] = {"x": 1}
    VALIDATOR.validate(doc)
    assert decode_message(json.dumps(doc)) == [_op()]


def _mutations() -> list[tuple[str, Any]]:
    """(id, document) pairs that the schema rejects."""
    op = json.loads(encode_message(_op()))
    pr = json.loads(encode_message(_progress()))

    def without(doc: dict[str, Any], key: str) -> dict[str, Any]:
        d = copy.deepcopy(doc)
        del d[key]
        return d

    def with_(doc: dict[str, Any], **kw: Any) -> dict[str, Any]:
        d = copy.deepcopy(doc)
        d.update(kw)
        return d

    cases: list[tuple[str, Any]] = []
    for key in [
        "v",
        "job",
        "comm",
        "nranks",
        "rank",
        "host",
        "ts_us",
        "kind",
        "op",
        "seq",
        "bytes",
        "exec_us",
    ]:
        cases.append((f"op-missing-{key}", without(op, key)))
    for key in ["started", "completed", "kind"]:
        cases.append((f"progress-missing-{key}", without(pr, key)))
    cases += [
        ("v-2", with_(op, v=2)),
        ("kind-unknown", with_(op, kind="opp")),
        ("empty-job", with_(op, job="")),
        ("nranks-0", with_(op, nranks=0)),
        ("rank-negative", with_(op, rank=-1)),
        ("seq-string", with_(op, seq="41")),
        ("bytes-negative", with_(op, bytes=-5)),
        ("exec-negative", with_(op, exec_us=-0.5)),
        ("ts-float", with_(op, ts_us=1.5)),
        ("nic-int", with_(op, nic=3)),
        ("conn-bad-dir", with_(op, conns=[{"peer": 1, "dir": "up", "bytes": 1}])),
        ("conn-missing-peer", with_(op, conns=[{"dir": "send", "bytes": 1}])),
        (
            "conn-neg-retrans",
            with_(op, conns=[{"peer": 1, "dir": "send", "bytes": 1, "retrans": -1}]),
        ),
        ("started-negative", with_(pr, started=-3)),
        ("inflight-negative", with_(pr, inflight_us=-1)),
        ("not-an-object", 42),
        ("array-of-junk", [op, "x"]),
        ("nested-array", [[op]]),
    ]
    return cases


@pytest.mark.parametrize("doc", [d for _, d in _mutations()], ids=[i for i, _ in _mutations()])
def test_what_the_schema_rejects_the_decoder_rejects(doc: Any) -> None:
    assert not VALIDATOR.is_valid(doc), "mutation should break the schema"
    with pytest.raises(EventDecodeError) as err:
        decode_message(json.dumps(doc))
    # The message says what is wrong, in words a person can act on.
    assert len(str(err.value)) > 10


def test_explicit_null_optional_field_reads_as_absent() -> None:
    # Deliberate leniency beyond the schema: exporters in other languages often write
    # null for "unknown"; we read it as absent, and never write null ourselves.
    doc = json.loads(encode_message(_op()))
    doc["gpu"] = None
    assert not VALIDATOR.is_valid(doc)
    (ev,) = decode_message(json.dumps(doc))
    assert ev.gpu is None
    assert b"null" not in encode_message(ev)


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"null", b'{"kind":"op"'])
def test_malformed_json_gives_a_clear_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_message(data)


def test_error_names_the_field_and_position() -> None:
    batch = json.loads(encode_message([_op(), _op()]))
    batch[1]["seq"] = -1
    with pytest.raises(EventDecodeError, match=r"seq"):
        decode_message(json.dumps(batch))
