"""Signed messages (issue 12, "the exporter's identity checked against the host it
reports for"): the signing primitives, key files, and the worker's decode step refusing
what a forger can write to an open ``c4.events`` — broker-free; the same through the
real broker is in test_forged.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from c4base.kafka import KafkaConfig
from c4base.signing import (
    HOST_HEADER,
    SIG_HEADER,
    KeyFileError,
    command_bytes,
    command_refusal,
    commands_key,
    generate_key_file,
    host_key,
    load_key,
    load_keys,
    sign,
    signed_event_headers,
    write_key_file,
)
from c4stream.config import check_config
from c4stream.config_warnings import config_warnings
from producers.columnar import encode_batch
from producers.events import OpEvent, encode_message
from producers.replay import ReplayConfig, replay
from producers.traces import TraceWriter
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter
from streams.app.engine import CoreEngine
from streams.app.trust import EventTrust
from tests.kafka_helpers import consume

MASTER = bytes(range(32))
T0 = 1_750_000_000_000_000


def ev(host: str = "node-1", rank: int = 0, **kw: object) -> OpEvent:
    base: dict = dict(v=1, job="j", comm="0xa", nranks=4, rank=rank, host=host, ts_us=T0,
                      op="AllReduce", seq=1, bytes=8, exec_us=10.0)  # fmt: skip
    base.update(kw)
    return OpEvent(**base)


def signed(events: list[OpEvent], host: str, *, key: bytes | None = None, fmt: str = "json"):
    """(value, headers) as the exporter of ``host`` sends it."""
    value, headers = encode_batch(events, fmt)  # type: ignore[arg-type]
    return value, signed_event_headers(key or host_key(MASTER, host), host, value, headers)


def rec(value: bytes, headers: list[tuple[str, bytes]] | None, offset: int = 0) -> Record:
    h = dict(headers or [])
    return Record("ev", 0, offset, b"0xa", value, None, h.get("content-type"),
                  h.get(HOST_HEADER), h.get(SIG_HEADER), h.get("c4-fresh"))  # fmt: skip


def router(masters: list[bytes] | None = None) -> CommRouter:
    return CommRouter(
        CoreEngine(),
        lambda key: None,
        checkpoint_every_events=10**9,
        checkpoint_every_s=1e9,
        advance_every_us=250_000,
        epoch=lambda: T0 / 1e6 + 60,
        trust=EventTrust(masters or [MASTER]),
    )


def reasons(r: CommRouter, *records: Record) -> list[str]:
    out = r.process(list(records))
    return [d.reason for d in out.deadletters]


# ------------------------------------------------------------------ primitives


def test_keys_are_per_host_and_per_purpose() -> None:
    a, b = host_key(MASTER, "node-1"), host_key(MASTER, "node-2")
    assert len({a, b, commands_key(MASTER), host_key(bytes(32), "node-1")}) == 4
    assert a == host_key(MASTER, "node-1")  # derived, so nothing to distribute but the key


@pytest.mark.parametrize("fmt", ["json", "arrow"])
def test_the_worker_accepts_its_hosts_signed_messages(fmt: str) -> None:
    r = router()
    assert reasons(r, rec(*signed([ev(), ev(rank=1)], "node-1", fmt=fmt))) == []
    assert r.stats.events == 2


@pytest.mark.parametrize("fmt", ["json", "arrow"])
def test_one_byte_tampered_anywhere_is_a_bad_signature(fmt: str) -> None:
    value, headers = signed([ev()], "node-1", fmt=fmt)
    for i in (0, len(value) // 2, len(value) - 1):
        bad = bytearray(value)
        bad[i] ^= 0x01
        (why,) = reasons(router(), rec(bytes(bad), headers, i))
        assert why.startswith("refused: bad signature: not signed by the key of node-1")
    # ...and in the signature itself, or the content type it covers.
    sig = dict(headers)[SIG_HEADER]
    h2 = [(k, sig[:-1] + (b"0" if sig[-1:] != b"0" else b"1") if k == SIG_HEADER else v)
          for k, v in headers]  # fmt: skip
    assert "bad signature" in reasons(router(), rec(value, h2))[0]
    if fmt == "arrow":
        h3 = [(k, b"application/json" if k == "content-type" else v) for k, v in headers]
        assert "bad signature" in reasons(router(), rec(value, h3))[0]


def test_a_message_moved_to_another_host_fails() -> None:
    # node-1's genuine message re-published as if node-2 had signed it.
    value, headers = signed([ev("node-1")], "node-1")
    moved = [(k, b"node-2" if k == HOST_HEADER else v) for k, v in headers]
    (why,) = reasons(router(), rec(value, moved))
    assert (
        why == "refused: bad signature: not signed by the key of node-2 (tampered, or another key)"
    )


@pytest.mark.parametrize("fmt", ["json", "arrow"])
def test_a_host_signs_only_for_itself(fmt: str) -> None:
    # node-3 is compromised: its own key is valid, but the events speak for node-1.
    (why,) = reasons(router(), rec(*signed([ev("node-1")], "node-3", fmt=fmt)))
    assert why == "refused: event host node-1 in a message signed by node-3"
    mixed = [ev("node-3", rank=3), ev("node-1", rank=1)]
    (why,) = reasons(router(), rec(*signed(mixed, "node-3", fmt=fmt)))
    assert why == "refused: event host node-1 in a message signed by node-3"
    # in one batch with good messages of its own, only the lie is refused
    r = router()
    good = rec(*signed([ev("node-3", rank=3)], "node-3", fmt=fmt), 1)
    lie = rec(*signed([ev("node-1", rank=1, seq=2)], "node-3", fmt=fmt), 2)
    assert reasons(r, good, lie) == ["refused: event host node-1 in a message signed by node-3"]
    assert r.stats.events == 1


def test_a_key_not_derived_from_the_master_fails() -> None:
    forged = signed([ev()], "node-1", key=host_key(os.urandom(32), "node-1"))
    assert "bad signature" in reasons(router(), rec(*forged))[0]


@pytest.mark.parametrize(
    "drop",
    [{HOST_HEADER}, {SIG_HEADER}, {HOST_HEADER, SIG_HEADER}],
    ids=["no c4-host", "no c4-sig", "neither"],
)
def test_missing_headers_are_unsigned(drop: set[str]) -> None:
    value, headers = signed([ev()], "node-1")
    (why,) = reasons(router(), rec(value, [(k, v) for k, v in headers if k not in drop]))
    assert why.startswith("refused: unsigned message")


def test_a_bad_host_header_is_refused_without_deriving_anything() -> None:
    value, headers = signed([ev()], "node-1")
    h = [(k, b"../../etc" if k == HOST_HEADER else v) for k, v in headers]
    assert "not an RFC 1123 name" in reasons(router(), rec(value, h))[0]
    h = [(k, b"v2=00" if k == SIG_HEADER else v) for k, v in headers]
    assert "bad signature" in reasons(router(), rec(value, h))[0]


def test_a_key_rotation_accepts_old_and_new_master() -> None:
    new = os.urandom(32)
    r = router([new, MASTER])
    old_msg = rec(*signed([ev()], "node-1"))
    new_msg = rec(*signed([ev(seq=2)], "node-1", key=host_key(new, "node-1")), 1)
    assert reasons(r, old_msg, new_msg) == []
    assert "bad signature" in reasons(router([new]), rec(*signed([ev()], "node-1")))[0]


def test_commands_are_signed_with_the_commands_key_only() -> None:
    k = commands_key(MASTER)
    value = b'{"id":"c4-1"}'
    assert command_refusal([k], value, sign(k, command_bytes(value))) is None
    assert "bad signature" in command_refusal([k], value + b" ", sign(k, command_bytes(value)))
    # An exporter's key (a compromised host) cannot sign commands.
    assert "bad signature" in command_refusal(
        [k], value, sign(host_key(MASTER, "node-1"), command_bytes(value))
    )
    assert command_refusal([k], value, None).startswith("unsigned command")


def test_unsigned_traffic_passes_when_signing_is_off() -> None:
    r = CommRouter(CoreEngine(), lambda key: None, checkpoint_every_events=10**9,
                   checkpoint_every_s=1e9, advance_every_us=250_000,
                   epoch=lambda: T0 / 1e6 + 60)  # fmt: skip
    out = r.process([Record("ev", 0, 0, b"0xa", encode_message([ev()]))])
    assert out.deadletters == [] and r.stats.events == 1


# ------------------------------------------------------------------ key files


def test_key_files_missing_short_not_hex_or_readable_by_others(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="does not exist"):
        load_key(tmp_path / "nope.key")
    short = write_key_file(tmp_path / "short.key", b"\x01" * 16)
    with pytest.raises(KeyFileError, match="holds 16 bytes, at least 32"):
        load_key(short)
    junk = tmp_path / "junk.key"
    junk.write_text("not hex at all\n")
    junk.chmod(0o600)
    with pytest.raises(KeyFileError, match="does not hold hex digits"):
        load_key(junk)
    good = generate_key_file(tmp_path / "m.key")
    assert oct(good.stat().st_mode & 0o777) == "0o600" and len(load_key(good)) == 32
    good.chmod(0o644)
    with pytest.raises(KeyFileError, match=r"readable or writable by others \(mode 644\)"):
        load_keys([good])
    with pytest.raises(KeyFileError, match="already exists"):
        generate_key_file(good)


def test_a_key_never_appears_in_an_error(tmp_path: Path) -> None:
    p = generate_key_file(tmp_path / "m.key")
    secret = p.read_text().strip()
    p.chmod(0o640)
    with pytest.raises(KeyFileError) as err:
        load_key(p)
    assert secret not in str(err.value)


@pytest.mark.kafka
@pytest.mark.timeout(90)
def test_replay_signs_each_hosts_events_with_its_key(
    tmp_path: Path, kafka_bootstrap: str, make_topics
) -> None:
    topics = make_topics({"events": 1, "deadletter": 1})
    trace = tmp_path / "t.jsonl"
    with TraceWriter(trace) as w:
        for seq in range(3):  # one line = one message of four hosts
            w.write([ev(f"node-{r}", rank=r, seq=seq + 1, ts_us=T0 + seq) for r in range(4)])
    master_file = generate_key_file(tmp_path / "master.key")
    cfg = ReplayConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap), events_topic=topics["events"],
        deadletter_topic=topics["deadletter"], speed=None, progress=False, sign_with=master_file,
    )  # fmt: skip
    stats = replay([trace], cfg)
    assert stats.ok and (stats.messages, stats.events) == (12, 12)
    r = router([load_key(master_file)])
    got = consume(kafka_bootstrap, topics["events"], expect=12)
    recs = [rec(m.value(), m.headers(), i) for i, m in enumerate(got)]
    assert {x.signer for x in recs} == {b"node-0", b"node-1", b"node-2", b"node-3"}
    assert reasons(r, *recs) == [] and r.stats.events == 12


def test_config_check_names_what_is_wrong_with_signing(tmp_path: Path) -> None:
    key = generate_key_file(tmp_path / "m.key")
    loose = write_key_file(tmp_path / "loose.key", bytes(32))
    loose.chmod(0o644)
    text = (
        "[worker]\nrequire_signed_events = true\n"
        f'[exporter]\ndirectory = "{tmp_path}"\nsigning_key_file = "{key}"\n'
        f'[actuator]\nrequire_signed_commands = true\ncommand_key_files = ["{loose}"]\n'
    )
    got = {r.section: r.message for r in check_config(text=text, env={}) if not r.ok}
    assert "require_signed_events = true needs master_key_files" in got["worker"]
    assert "signing_key_file needs host" in got["exporter"]
    assert "readable or writable by others (mode 644)" in got["actuator"]
    ok = f'[actuator]\nrequire_signed_commands = true\ncommand_key_files = ["{key}"]\n'
    assert all(r.ok for r in check_config(text=ok, env={}))
    (warning,) = config_warnings(text=ok, env={})
    assert "the worker signs no command" in warning.message
    ok += f'[worker]\nmaster_key_files = ["{key}"]\n'
    (warning,) = config_warnings(text=ok, env={})  # events unsigned: said loudly
    assert warning.message.startswith("SIGNING IS OFF: [worker] require_signed_events")
    ok += "require_signed_events = true\n"
    assert config_warnings(text=ok, env={}) == []


def test_the_production_example_signs_everything(tmp_path: Path) -> None:
    """docs/examples/production.toml checks clean once its key files exist, with no
    SIGNING IS OFF line."""
    text = (Path(__file__).resolve().parents[2] / "docs/examples/production.toml").read_text()
    master = load_key(generate_key_file(tmp_path / "master.key"))
    write_key_file(tmp_path / "exporter.key", host_key(master, "node-001"))
    write_key_file(tmp_path / "commands.key", commands_key(master))
    text = text.replace("/etc/c4stream/", f"{tmp_path}/")
    (tmp_path / "master.key").chmod(0o600)
    bad = {r.section: r.message for r in check_config(text=text, env={}) if not r.ok}
    assert bad == {}
    warnings = [w.message for w in config_warnings(text=text, env={})]
    assert not any("SIGNING IS OFF" in w for w in warnings), warnings
    assert "require_signed_events = true" in text and "require_signed_commands = true" in text
