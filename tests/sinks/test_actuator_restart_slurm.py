"""Restart after isolation against a real Slurm (tests/slurm_fixture.py) and a real broker.

A batch job runs on the node that gets drained; the isolation command comes through
Kafka twice (a redelivery). The actuator drains the node with the Slurm backend, finds
the job with ``squeue -w <node> -n <job>`` and requeues it with ``scontrol requeue``:
once. The redelivered command, and the whole topic read again by a restarted actuator
(a new consumer group, as if the offsets were lost), requeue nothing more. Two more
faults of the job, with the clock rail off, are refused by what the real scheduler
says: the requeued job no longer runs on the node (lookup), and it is PENDING (state).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Producer

from c4base.kafka import KafkaConfig
from sinks.actuator.config import ActuatorConfig, RestartSettings, SlurmSettings
from sinks.actuator.consumer import Actuator, run
from sinks.actuator.ledger import Ledger
from sinks.actuator.restart import RestartHook, RestartLog
from sinks.actuator.restart_command import slurm_restarter
from sinks.actuator.slurm_backend import SlurmBackend
from streams.commands import IsolationCommand, encode_command
from tests.slurm_fixture import SlurmCluster

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]

JOB = "llm-70b"


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for v in values:
        p.produce(topic, v, key=b"node")
    assert p.flush(30) == 0


def test_the_job_on_the_drained_node_is_requeued_once(
    kafka_bootstrap: str,
    make_topics: Callable[..., dict[str, str]],
    slurm_cluster: SlurmCluster,
    tmp_path: Path,
) -> None:
    c = slurm_cluster
    if c.compute_node is None:
        pytest.skip("no slurmd here (needs root): batch jobs cannot run")
    node = c.compute_node
    job = c.sbatch("sleep 300", "-J", JOB, "--requeue")
    assert c.wait_job_state(job, "RUNNING") == "RUNNING"
    assert c.job(job)["Restarts"] == "0"

    topics = make_topics({"isolations": 1, "deadletter": 1})
    cmd = IsolationCommand(
        id="c4-slurm-1",
        ts_us=1_000_000,
        job=JOB,
        host=node,
        gpu=3,
        fault="noncomm_hang",
        action="cordon_and_taint",
        confidence=0.97,
        reason=f"{node} GPU 3 hangs: it has not started collective 12 while its peers waited.",
        evidence={},
        dry_run=False,  # the worker decided to act (a command without it is a dry run)
    )
    produce(kafka_bootstrap, topics["isolations"], [encode_command(cmd)] * 2)
    ledger = tmp_path / "ledger.sqlite3"

    def actuate(group: str) -> tuple[dict[str, int], int]:
        cfg = ActuatorConfig(
            kafka=KafkaConfig(bootstrap=kafka_bootstrap),
            group=group,
            backend="slurm",
            execute=True,
            isolations=topics["isolations"],
            deadletter=topics["deadletter"],
            exit_when_idle_s=1.5,
            publish_outcomes=False,
            slurm=SlurmSettings(slurm_conf=str(c.conf)),
            restart=RestartSettings(jobs=("llm-*",), execute=True),
        )
        restarter = slurm_restarter(cfg.slurm, cfg.restart, check_programs=True)
        with Ledger(ledger) as led, RestartLog(ledger) as rl:
            hook = RestartHook(cfg.restart, restarter, rl, retry_backoff_s=0.2)
            stats = run(cfg, SlurmBackend(cfg.slurm), led, restart=hook)
        return stats.by_decision, stats.received

    # Group names of its own: consumer groups are broker-wide, and another test's
    # actuator in a group of the same name could be handed this test's partition.
    decisions, received = actuate(f"restart-slurm-1-{uuid.uuid4().hex[:8]}")
    assert received == 2 and decisions == {"acted": 1, "duplicate": 1}, decisions

    state = c.node(node)
    assert "DRAIN" in state["State"].split("+") or "DRAIN" in state["State"], state
    assert state["Reason"].startswith("c4stream c4-slurm-1: ")
    info = c.job(job)
    assert info["Restarts"] == "1", info
    assert info["JobState"] != "RUNNING"  # requeued; its node is drained, so it waits
    with RestartLog(ledger) as rl:
        [row] = rl.entries()
    assert (row.id, row.job, row.host, row.target, row.status) == (
        "c4-slurm-1",
        JOB,
        node,
        job,
        "done",
    )
    assert f"requeue {job}" in row.detail

    # One more delivery, then a restarted actuator reading the topic from the start.
    produce(kafka_bootstrap, topics["isolations"], [encode_command(cmd)])
    decisions, received = actuate(f"restart-slurm-2-{uuid.uuid4().hex[:8]}")
    assert received == 3 and decisions == {"duplicate": 3}, decisions
    assert c.job(job)["Restarts"] == "1"

    # More faults of the same job while it waits to run again, with the time rail off
    # (in_progress_s 0): the scheduler's own answers stop a second requeue.
    rs = RestartSettings(jobs=("llm-*", "slurm-*"), execute=True, in_progress_s=0)
    cfg = ActuatorConfig(
        backend="slurm", execute=True, slurm=SlurmSettings(slurm_conf=str(c.conf)), restart=rs
    )
    with Ledger(ledger) as led, RestartLog(ledger) as rl:
        hook = RestartHook(rs, slurm_restarter(cfg.slurm, rs, check_programs=True), rl)
        act = Actuator(cfg, SlurmBackend(cfg.slurm), led, restart=hook)
        # found by name on the node: the requeued job is not there any more. Another GPU
        # of the host: the same fault again would be a duplicate by fault identity.
        h = act.handle(msgspec.structs.replace(cmd, id="c4-slurm-2", gpu=5))
        assert h.status == "done", h  # the node stays drained by c4stream
        second = rl.get("c4-slurm-2")
        assert second is not None and second.status == "skipped"
        assert f"no job named '{JOB}' runs on {node}" in second.detail
        # the job id in the telemetry's job name: squeue -j says PENDING
        regex = msgspec.structs.replace(rs, jobid_regex=r"slurm-(?P<jobid>[0-9]+)")
        act.restart = RestartHook(regex, slurm_restarter(cfg.slurm, regex, check_programs=True), rl)
        act.handle(msgspec.structs.replace(cmd, id="c4-slurm-3", job=f"slurm-{job}"))
        third = rl.get("c4-slurm-3")
        assert third is not None and third.status == "skipped"
        assert f"job {job} is PENDING: a restart is in progress" in third.detail
    assert c.job(job)["Restarts"] == "1"
