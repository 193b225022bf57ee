"""An actuator with ``require_signed_commands`` acts only on commands the worker signed
(issue 12, part 5), through the real broker: unsigned, forged and tampered commands are
dead-lettered with the reason and reported ``denied`` on ``c4.actions``, never acted on."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from c4base.deadletter import DeadLetter
from c4base.kafka import KafkaConfig
from c4base.signing import (
    command_bytes,
    commands_key,
    generate_key_file,
    host_key,
    load_key,
    sign,
    write_key_file,
)
from sinks.actuator.config import ActuatorConfig
from sinks.actuator.consumer import run
from sinks.actuator.ledger import Ledger
from sinks.actuator.outcomes import decode_report
from streams.app.trust import CommandSigner
from streams.commands import IsolationCommand, encode_command
from tests.chaos.harness import Recording, produce, read

pytestmark = pytest.mark.kafka

SCHEMA = Path(__file__).resolve().parents[2] / "sinks" / "contracts" / "action-report.schema.json"


def cmd(i: int) -> bytes:
    return encode_command(
        IsolationCommand(
            id=f"c4-{i}",
            ts_us=1,
            job="j",
            host=f"node-{i:03d}",
            fault="straggler",
            action="cordon",
            confidence=0.9,
            reason="r",
            evidence={},
            gpu=1,
            dry_run=False,
        )  # fmt: skip
    )


@pytest.mark.timeout(120)
def test_only_commands_signed_by_the_worker_act(
    kafka_bootstrap: str, make_topics, tmp_path: Path
) -> None:
    t = make_topics({"isolations": 1, "deadletter": 1, "actions": 1})
    master = load_key(generate_key_file(tmp_path / "master.key"))
    key_file = write_key_file(tmp_path / "commands.key", commands_key(master))
    worker = CommandSigner(master)  # what the worker puts on each command it produces
    genuine = cmd(1)
    tampered = bytearray(cmd(3))
    tampered[tampered.index(b"node-003") + 7] = ord("9")  # node-003 -> node-009
    host_signed = sign(host_key(master, "node-004"), command_bytes(cmd(4)))
    msgs = [
        (b"node-001", genuine, worker.headers(genuine)),
        (b"node-002", cmd(2), None),  # unsigned, e.g. written by anyone with access
        (b"node-009", bytes(tampered), worker.headers(cmd(3))),
        (b"node-004", cmd(4), [("c4-sig", host_signed)]),  # a compromised exporter's key
        (b"node-005", b'{"evidence":' + b"[" * 3000 + b"]" * 3000 + b"}", None),  # poison
    ]
    produce(kafka_bootstrap, t["isolations"], msgs)
    cfg = ActuatorConfig(
        kafka=KafkaConfig(bootstrap=kafka_bootstrap),
        execute=True,
        isolations=t["isolations"],
        deadletter=t["deadletter"],
        actions=t["actions"],
        group=f"act-{tmp_path.name}",
        exit_when_idle_s=3.0,
        require_signed_commands=True,
        command_key_files=(str(key_file),),
    )
    backend = Recording()
    with Ledger(tmp_path / "ledger.sqlite3") as led:
        stats = run(cfg, backend, led)
    assert backend.applied == ["node-001"]
    assert stats.refused == 4 and stats.received == 5

    dls = [DeadLetter.decode(v) for v in read(kafka_bootstrap, t["deadletter"],
                                              until=lambda v: len(v) >= 4, timeout=20)]  # fmt: skip
    assert [d.key for d in dls] == ["node-002", "node-009", "node-004", "node-005"]
    assert dls[0].reason.startswith("refused isolation command: unsigned command")
    assert all("bad signature" in d.reason for d in dls[1:3])
    assert "unsigned" in dls[3].reason  # refused before anything decodes it

    raw = read(kafka_bootstrap, t["actions"], until=lambda v: len(v) >= 4, timeout=20)
    schema = json.loads(SCHEMA.read_text())
    for v in raw:
        jsonschema.validate(json.loads(v), schema)  # no new value in the contract
    reports = {r.command_id: r for r in map(decode_report, raw)}
    assert reports["c4-1"].outcome == "acted"
    for i in (2, 3, 4):  # the poison pill has no command to report under
        r = reports[f"c4-{i}"]
        assert (r.decision, r.status) == ("denied", "skipped") and r.detail.startswith("refused:")
    assert len(reports) == 4


def test_require_signed_commands_needs_a_key_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs command_key_files"):
        ActuatorConfig(require_signed_commands=True)
    with pytest.raises(ValueError, match="does not exist"):
        ActuatorConfig(require_signed_commands=True, command_key_files=(str(tmp_path / "k"),))
