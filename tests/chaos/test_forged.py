"""Forged commands on ``c4.isolations`` (issue 12, defect 5), through the real broker and
the actuator's own Kafka loop with an executing (``--execute``) configuration.

What is refused whatever the topic's ACLs: commands that do not say ``dry_run: false``,
host names that are not host names, poison pills; what gets through a topic anyone may
write is bounded by the actuator's own cap per job per hour (the defence for the rest
is the ACL: only the worker's principal may write ``c4.isolations``, docs/security.md).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest

from c4base.kafka import KafkaConfig
from c4base.signing import (
    command_bytes,
    commands_key,
    generate_key_file,
    host_key,
    load_key,
    sign,
    signed_event_headers,
    write_key_file,
)
from producers.events import Event, ProgressEvent, encode_message
from producers.simulator import simulate
from sinks.actuator.config import ActuatorConfig
from sinks.actuator.consumer import run
from sinks.actuator.ledger import Ledger
from streams.commands import IsolationCommand, encode_command
from streams.worker import start_worker_process
from tests.chaos.harness import (
    ROWS,
    SIM,
    Recording,
    Row,
    as_messages,
    commands,
    deadletters,
    produce,
    worker_config,
)

pytestmark = pytest.mark.kafka


def forged(i: int, **kw: object) -> bytes:
    cmd = IsolationCommand(
        id=f"forged-{i}", ts_us=1, job="victim-job", host=f"node-{i:03d}", fault="straggler",
        action="cordon_and_taint", confidence=1.0, reason="trust me", evidence={},
    )  # fmt: skip
    d = json.loads(encode_command(cmd))
    d.update(kw)
    return json.dumps(d).encode()


@pytest.mark.timeout(120)
def test_forged_commands_are_bounded_by_the_actuator(
    kafka_bootstrap: str, make_topics, tmp_path: Path
) -> None:
    t = make_topics({"isolations": 1, "deadletter": 1})
    batches = {
        "no dry_run": [forged(i) for i in range(20)],
        "dry_run false": [forged(100 + i, dry_run=False) for i in range(20)],
        "bad host": [
            forged(200 + i, dry_run=False, host=h)
            for i, h in enumerate(["--all", "*", "../../etc", "a\nb", "-rf"] * 4)
        ],
        "poison": [b'{"evidence":' + b"[" * 3000 + b"]" * 3000 + b"}"] * 20,
    }
    msgs = [(None, v) for vs in batches.values() for v in vs]
    produce(kafka_bootstrap, t["isolations"], msgs)
    cfg = ActuatorConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        execute=True,
        isolations=t["isolations"],
        deadletter=t["deadletter"],
        group=f"act-{tmp_path.name}",
        exit_when_idle_s=3.0,
    )
    backend = Recording()
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        stats = run(cfg, backend, led)
    dls = deadletters(kafka_bootstrap, t["deadletter"], want=40, timeout=20)
    ROWS.append(
        Row(
            "forged commands on c4.isolations, actuator --execute",
            sent=len(msgs),
            deadlettered=len(dls),
            acted=len(backend.applied),
            false_isolations=len(backend.applied),
            notes=(
                f"{stats.by_decision.get('dry_run', 0)} dry run (no dry_run field), "
                f"{stats.by_decision.get('capped', 0)} capped; the rest needs Kafka ACLs"
            ),
        )
    )
    assert stats.received == len(msgs) and stats.invalid == 40
    assert len(dls) == 40 and all("invalid isolation command" in d.reason for d in dls)
    assert stats.by_decision.get("dry_run") == 20
    assert backend.applied == ["node-100", "node-101"]  # the cap of 2 per job per hour
    assert stats.by_decision.get("capped") == 18


def forged_heartbeats(good: list[list[Event]], victim: str, after_us: int) -> list[list[Event]]:
    """Heartbeats of every peer of ``victim`` claiming to be 3 collectives ahead and
    waiting in the next one: ``victim`` looks like the rank that never joined."""
    t0 = min(e.ts_us for b in good for e in b)
    comms = {e.comm for b in good for e in b if e.host == victim}
    out: dict[str, list[Event]] = {}
    for b in good:
        for e in b:
            if (
                isinstance(e, ProgressEvent)
                and e.comm in comms
                and e.host != victim
                and e.ts_us >= t0 + after_us
            ):
                out.setdefault(e.comm, []).append(
                    msgspec.structs.replace(
                        e,
                        started=e.started + 3,
                        inflight_op="AllReduce",
                        inflight_us=float(e.ts_us - t0 - after_us),
                        ts_us=e.ts_us + 1000,
                    )
                )
    return list(out.values())


@pytest.mark.timeout(180)
def test_forged_heartbeats_cannot_get_a_healthy_host_isolated(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    good = [b for b in simulate(msgspec.structs.replace(SIM, faults=[])) if b]
    forged = forged_heartbeats(good, "node-001", 8_000_000)
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    msgs = as_messages(good)
    # The forger's messages go out in the middle of the real stream.
    mixed = msgs[: len(msgs) // 2] + as_messages(forged) + msgs[len(msgs) // 2 :]
    with start_worker_process(cfg) as w:
        w.wait_ready(90)
        produce(kafka_bootstrap, cfg.topics().events, mixed)
        w.wait_for(lambda s: s["detect"]["messages"] >= len(mixed), 90, "through")
        time.sleep(3)
        st = w.status()
        assert w.stop() == 0
    cmds = commands(kafka_bootstrap, cfg.topics().isolations, timeout=3)
    iso = [c for c in cmds if c.action != "alert_only"]
    ROWS.append(
        Row(
            "forged heartbeats: node-001's peers 'ahead' (healthy job)",
            sent=len(mixed),
            deadlettered=st["deadletters_sent"],
            false_isolations=len(iso),
            found="0/0",
            notes=f"{len(forged)} forged messages, {sum(map(len, forged))} events",
        )
    )
    assert iso == []


# ------------------------------------------------- forged hang, with and without signing


def forged_waiting(good: list[list[Event]], victim: str, after_us: int) -> list[list[Event]]:
    """The issue's forged cordon, within the physics of a healthy job: right behind each
    real heartbeat of ``victim``'s peers (in every communicator it shares with them), a
    copy that says the peer has started one more collective and has sat in it for 30 s.
    The peers look stuck waiting while ``victim``'s own (real) counter is one behind:
    ``victim`` is the rank that never joined. The counters never go back — the peer's
    next real heartbeat, a second later, is already further on — so counter checks alone
    see no second source."""
    t0 = min(e.ts_us for b in good for e in b)
    comms = {e.comm for b in good for e in b if e.host == victim}
    out: list[list[Event]] = []
    for b in good:
        fake = [
            msgspec.structs.replace(
                e,
                started=e.started + 1,
                inflight_op="AllReduce",
                inflight_us=30e6,
                ts_us=e.ts_us + 1000,
            )  # fmt: skip
            for e in b
            if isinstance(e, ProgressEvent)
            and e.comm in comms
            and e.host != victim
            and e.ts_us >= t0 + after_us
        ]
        out.append(fake)
    return out


def interleave(good: list[list[Event]], forged: list[list[Event]]) -> list[list[Event]]:
    """Each forged batch right behind the real batch it copies (alongside the exporters)."""
    return [x for g, f in zip(good, forged, strict=True) for x in ([g, f] if f else [g])]


def sign_per_host(batches: list[list[Event]], master: bytes, forged: set[int]):
    """Messages as signing exporters send them (one per host per batch); batches whose
    index is in ``forged`` alternate between unsigned and signed by node-003's own key
    (a compromised host speaking for its peers)."""
    msgs: list[tuple[bytes | None, bytes, list[tuple[str, bytes]] | None]] = []
    for i, b in enumerate(batches):
        if i in forged:
            value = encode_message(b)
            k = len(msgs) % 2
            hs = (
                signed_event_headers(host_key(master, "node-003"), "node-003", value) if k else None
            )
            msgs.append((b[0].comm.encode(), value, hs))
            continue
        by_host: dict[str, list[Event]] = {}
        for e in b:
            by_host.setdefault(e.host, []).append(e)
        for host, evs in by_host.items():
            value = encode_message(evs)
            hs = signed_event_headers(host_key(master, host), host, value)
            msgs.append((b[0].comm.encode(), value, hs))
    return msgs


def run_worker(cfg, msgs, *, wait_messages: int) -> dict:
    with start_worker_process(cfg) as w:
        w.wait_ready(90)
        produce(cfg.kafka.bootstrap, cfg.topics().events, msgs)
        w.wait_for(lambda s: s["detect"]["messages"] >= wait_messages, 90, "through")
        time.sleep(3)
        st = w.status()
        assert w.stop() == 0
    return st


VICTIM = "node-001"


@pytest.mark.timeout(180)
def test_forged_hang_without_signing_is_held_by_corroboration(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    good = [b for b in simulate(msgspec.structs.replace(SIM, faults=[])) if b]
    forged = forged_waiting(good, VICTIM, 8_000_000)
    mixed = interleave(good, forged)
    n_forged = sum(1 for f in forged if f)
    cfg = worker_config(kafka_bootstrap, tmp_path / "w")
    st = run_worker(cfg, as_messages(mixed), wait_messages=len(mixed))
    cmds = commands(kafka_bootstrap, cfg.topics().isolations, timeout=3)
    iso = [c for c in cmds if c.action != "alert_only"]
    ROWS.append(
        Row(
            f"forged hang of {VICTIM}, peers 'waiting 30 s' (signing off)",
            sent=len(mixed),
            deadlettered=st["deadletters_sent"],
            false_isolations=len(iso),
            found="0/0",
            notes=f"{n_forged} forged messages, {sum(map(len, forged))} events; "
            f"{st['contested_comms']} communicators contested, "
            f"{sum(c.action == 'alert_only' for c in cmds)} alert-only",
        )
    )
    assert iso == []


@pytest.mark.timeout(180)
def test_forged_hang_with_signing_is_dead_lettered(kafka_bootstrap: str, tmp_path: Path) -> None:
    master_file = generate_key_file(tmp_path / "master.key")
    master = load_key(master_file)
    good = [b for b in simulate(msgspec.structs.replace(SIM, faults=[])) if b]
    mixed = interleave(good, forged_waiting(good, VICTIM, 8_000_000))
    forged_at = {i for i, b in enumerate(mixed) if any(
        isinstance(e, ProgressEvent) and e.inflight_us == 30e6 for e in b)}  # fmt: skip
    msgs = sign_per_host(mixed, master, forged_at)
    cfg = worker_config(
        kafka_bootstrap, tmp_path / "w", require_signed_events=True,
        master_key_files=(str(master_file),),
    )  # fmt: skip
    st = run_worker(cfg, msgs, wait_messages=len(msgs))
    cmds = commands(kafka_bootstrap, cfg.topics().isolations, timeout=3)
    dls = deadletters(kafka_bootstrap, cfg.topics().deadletter, want=len(forged_at), timeout=10)
    iso = [c for c in cmds if c.action != "alert_only"]
    unsigned = sum(d.reason.startswith("refused: unsigned message") for d in dls)
    other = sum(" in a message signed by node-003" in d.reason for d in dls)
    ROWS.append(
        Row(
            f"forged hang of {VICTIM} (signing on; real exporters sign)",
            sent=len(msgs),
            deadlettered=len(dls),
            false_isolations=len(iso),
            found="0/0",
            notes=f"{len(forged_at)} forged messages: {unsigned} unsigned, {other} signed by "
            "node-003 for its peers; every real message accepted",
        )
    )
    assert len(dls) == len(forged_at) == unsigned + other and unsigned and other
    assert st["detect"]["events"] == sum(map(len, good))  # all the real traffic was judged
    assert iso == [] and cmds == []


@pytest.mark.timeout(120)
def test_forged_commands_act_on_nothing_when_commands_are_signed(
    kafka_bootstrap: str, make_topics, tmp_path: Path
) -> None:
    t = make_topics({"isolations": 1, "deadletter": 1})
    master = load_key(generate_key_file(tmp_path / "master.key"))
    key_file = write_key_file(tmp_path / "commands.key", commands_key(master))
    fake_key = host_key(master, "node-003")  # a compromised exporter's key
    msgs: list = [(None, forged(i)) for i in range(20)]
    msgs += [(None, forged(100 + i, dry_run=False)) for i in range(20)]
    msgs += [
        (None, v, [("c4-sig", sign(fake_key, command_bytes(v)))])
        for v in (forged(200 + i, dry_run=False) for i in range(20))
    ]
    produce(kafka_bootstrap, t["isolations"], msgs)
    cfg = ActuatorConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap), execute=True,
        isolations=t["isolations"], deadletter=t["deadletter"], group=f"act-{tmp_path.name}",
        exit_when_idle_s=3.0, require_signed_commands=True, command_key_files=(str(key_file),),
    )  # fmt: skip
    backend = Recording()
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        stats = run(cfg, backend, led)
    dls = deadletters(kafka_bootstrap, t["deadletter"], want=len(msgs), timeout=20)
    ROWS.append(
        Row(
            "forged commands, actuator --execute with require_signed_commands",
            sent=len(msgs),
            deadlettered=len(dls),
            acted=len(backend.applied),
            false_isolations=len(backend.applied),
            notes=f"{stats.refused} refused: 40 unsigned, 20 signed with an exporter's key",
        )
    )
    assert backend.applied == [] and stats.refused == len(msgs) == len(dls)
    assert all(d.reason.startswith("refused isolation command: ") for d in dls)
