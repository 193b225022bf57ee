"""Forged commands on ``c4.isolations`` (issue 12, defect 5), through the real broker and
the actuator's own Kafka loop with an executing (``--execute``) configuration.

What is refused whatever the topic's ACLs: commands that do not say ``dry_run: false``,
host names that are not host names, poison pills; what gets through a topic anyone may
write is bounded by the actuator's own cap per job per hour (the defence for the rest
is the ACL: only the worker's principal may write ``c4.isolations``, docs/security.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from c4stream.kafka import KafkaConfig
from sinks.actuator.config import ActuatorConfig
from sinks.actuator.consumer import run
from sinks.actuator.ledger import Ledger
from streams.commands import IsolationCommand, encode_command
from tests.chaos.harness import ROWS, Recording, Row, deadletters, produce

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
