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
    Sequencer,
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
from streams.app.deadletter import Record
from streams.app.detect_runner import CommRouter
from streams.app.engine import CoreEngine
from streams.commands import IsolationCommand, encode_command
from streams.core.config import PolicyConfig
from streams.worker import start_worker_process
from tests.chaos.harness import (
    ROWS,
    SIM,
    TRUTH,
    Recording,
    Row,
    as_messages,
    commands,
    deadletters,
    produce,
    trace,
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
    """Messages as signing exporters send them (one per host per batch); the batches
    whose index is in ``forged`` go out alternately unsigned and signed by node-003's own
    key (a compromised host: it may speak for itself, not for its peers)."""
    msgs: list[tuple[bytes | None, bytes, list[tuple[str, bytes]] | None]] = []
    seq = Sequencer()  # (one counter for all hosts: each host's numbers still grow)
    for i, b in enumerate(batches):
        if i in forged:
            value = encode_message(b)
            own = sum(1 for j in forged if j < i) % 2
            hs = (
                signed_event_headers(
                    host_key(master, "node-003"), "node-003", value, fresh=seq.next()
                )  # fmt: skip
                if own
                else None
            )
            msgs.append((b[0].comm.encode(), value, hs))
            continue
        by_host: dict[str, list[Event]] = {}
        for e in b:
            by_host.setdefault(e.host, []).append(e)
        for host, evs in by_host.items():
            value = encode_message(evs)
            hs = signed_event_headers(host_key(master, host), host, value, fresh=seq.next())
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
    forged_at = sorted(i for i, b in enumerate(mixed) if any(
        isinstance(e, ProgressEvent) and e.inflight_us == 30e6 for e in b))  # fmt: skip
    msgs = sign_per_host(mixed, master, set(forged_at))
    # node-003 may sign what it says of itself: those pass the signature check (and
    # meet the corroboration rules); every other forged message must be refused.
    own = [
        i for k, i in enumerate(forged_at) if k % 2 and {e.host for e in mixed[i]} == {"node-003"}
    ]
    self_only = len(own)
    cfg = worker_config(
        kafka_bootstrap, tmp_path / "w", require_signed_events=True,
        master_key_files=(str(master_file),),
    )  # fmt: skip
    st = run_worker(cfg, msgs, wait_messages=len(msgs))
    cmds = commands(kafka_bootstrap, cfg.topics().isolations, timeout=3)
    want = len(forged_at) - self_only
    dls = deadletters(kafka_bootstrap, cfg.topics().deadletter, want=want, timeout=30)
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
            notes=f"{len(forged_at)} forged messages: {unsigned} unsigned and {other} signed "
            f"by node-003 for its peers refused; {self_only} signed by node-003 about "
            f"itself accepted ({st['contested_comms']} communicators contested)",
        )
    )
    assert len(dls) == st["deadletters_sent"] == want == unsigned + other and unsigned and other
    real = sum(map(len, good))
    assert st["detect"]["events"] == real + sum(len(mixed[i]) for i in own)  # all real judged
    assert iso == []


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


def hb(rank: int, started: int, completed: int, ts: int, inflight_us: float | None = None):
    return ProgressEvent(
        v=1, job="j", comm="0xa", nranks=4, rank=rank, host=f"node-{rank}", ts_us=ts,
        started=started, completed=completed,
        inflight_op="AllReduce" if inflight_us is not None else None, inflight_us=inflight_us,
    )  # fmt: skip


T0 = 1_750_000_000_000_000


def router() -> CommRouter:
    return CommRouter(CoreEngine(), lambda key: None, checkpoint_every_events=10**9,
                      checkpoint_every_s=1e9, advance_every_us=250_000,
                      epoch=lambda: T0 / 1e6 + 60)  # fmt: skip


@pytest.mark.parametrize(
    ("second", "contested"),
    [
        (hb(0, 6, 5, T0 + 1_000_000, inflight_us=400_000), False),  # started 0.4 s ago: fine
        (hb(0, 6, 5, T0 + 1_000, inflight_us=30e6), True),  # "30 s" but 1 ms ago it had not
        (hb(0, 6, 5, T0 + 1_000_000, inflight_us=1.3e6), True),  # 1.3 s > 1 s + slack
        (hb(0, 5, 5, T0 + 1_000_000, inflight_us=30e6), False),  # same op: a real hang
        (hb(0, 4, 4, T0 + 1_000_000), True),  # counters went back
    ],
)
def test_a_heartbeat_must_fit_its_ranks_previous_one(
    second: ProgressEvent, contested: bool
) -> None:
    r = router()
    first = hb(0, 5, 5, T0)
    r.process(
        [Record("ev", 0, i, b"0xa", encode_message([e])) for i, e in enumerate([first, second])]
    )
    assert ("0xa" in r.contested) is contested


def test_a_heartbeat_stamped_earlier_may_not_say_more() -> None:
    r = router()
    # A forger stamps its copy 2 s ahead; the real heartbeat, stamped earlier, says more.
    evs = [hb(0, 5, 5, T0), hb(0, 6, 5, T0 + 2_000_000), hb(0, 8, 8, T0 + 1_000_000)]
    r.process([Record("ev", 0, i, b"0xa", encode_message([e])) for i, e in enumerate(evs)])
    assert "one stamped later" in r.contested["0xa"][1]


@pytest.mark.timeout(240)
def test_signed_end_to_end_the_real_fault_still_acts(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Signing on everywhere: exporters sign, the worker verifies and signs its
    command, the actuator (which holds only the commands key) checks it and acts."""
    master_file = generate_key_file(tmp_path / "master.key")
    master = load_key(master_file)
    key_file = write_key_file(tmp_path / "commands.key", commands_key(master))
    msgs = sign_per_host(trace(), master, set())
    cfg = worker_config(
        kafka_bootstrap, tmp_path / "w", require_signed_events=True,
        master_key_files=(str(master_file),), policy=PolicyConfig(dry_run=False),
    )  # fmt: skip
    st = run_worker(cfg, msgs, wait_messages=len(msgs))
    acfg = ActuatorConfig(
        kafka=cfg.kafka, execute=True, group=f"act-{tmp_path.name}", exit_when_idle_s=3.0,
        require_signed_commands=True, command_key_files=(str(key_file),),
    )  # fmt: skip
    backend = Recording()
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        stats = run(acfg, backend, led)
    ROWS.append(
        Row(
            "signing on end to end: rank hang, signed exporters, worker, actuator",
            sent=len(msgs),
            deadlettered=st["deadletters_sent"],
            acted=len(backend.applied),
            found=f"{int(backend.applied == [TRUTH[0]])}/1",
            false_isolations=sum(h != TRUTH[0] for h in backend.applied),
            notes=f"worker-signed commands: {stats.received}, refused: {stats.refused}",
        )
    )
    assert st["deadletters_sent"] == 0 and stats.refused == 0
    assert backend.applied == [TRUTH[0]]
