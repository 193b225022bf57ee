"""The downtime model: its arithmetic, and the measured latencies it reads from real runs."""

from __future__ import annotations

import pytest

from bench.bench_downtime import HANG_GROUPS, Measured, Model, measure, render, rows
from bench.bench_quality import run_scenario
from bench.scenarios import suite

pytestmark = pytest.mark.timeout(120)


def test_fault_rate_and_time_lost_follow_the_stated_assumptions() -> None:
    model = Model(checkpoint_min=30, restart_min=10, isolate_s=5, triage_min=0)
    # Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs.
    assert model.rate_per_gpu_day * 16_384 * 54 == pytest.approx(419)
    fast = Measured("a", faults=6, detected=6, localized=6, latency_s=6.0, false_hosts_per_fault=0)
    slow = Measured(
        "b", faults=6, detected=6, localized=0, latency_s=600.0, false_hosts_per_fault=0
    )
    table = {(r.gpus, r.detector): r for r in rows([fast, slow], model, [1024, 16_384])}
    a, b = table[(16_384, "a")], table[(16_384, "b")]
    assert a.faults_per_month == pytest.approx(419 / 54 * 30)
    # per fault: detect + isolate (localized) + restart + half a checkpoint interval
    assert a.per_fault_min == pytest.approx((6 + 5 + 600 + 900) / 60)
    assert b.per_fault_min == pytest.approx((600 + 600 + 900) / 60)
    assert b.hours_lost - a.hours_lost == pytest.approx(a.faults_per_month * (594 - 5) / 3600)
    assert a.percent == pytest.approx(100 * a.hours_lost / 720)
    # 16x the GPUs, 16x the faults, the same time per fault
    assert a.hours_lost == pytest.approx(16 * table[(1024, "a")].hours_lost)
    # triage is charged only where the culprit was not named
    t = Model(triage_min=60)
    assert rows([fast], t, [1024])[0].per_fault_min == rows([fast], model, [1024])[0].per_fault_min
    assert rows([slow], t, [1024])[0].per_fault_min == pytest.approx(b.per_fault_min + 60)


def test_measured_from_real_hang_runs_and_rendered_with_assumptions() -> None:
    results = [run_scenario(sc) for sc in suite(seeds=1, gpus=[128], only="rank_hang")]
    assert {r.group for r in results} == {"rank_hang"} and set(HANG_GROUPS) >= {"rank_hang"}
    by = {m.detector: m for m in measure(results)}
    assert by["c4stream"].localized == by["c4stream"].faults == 1
    assert by["watchdog"].localized == 0 and by["watchdog"].latency_s is not None
    assert by["watchdog"].latency_s >= 590  # the 10-minute timeout, in event time
    assert by["c4stream"].latency_s is not None and by["c4stream"].latency_s < 30
    text = render(list(by.values()), Model(), rows(list(by.values()), Model(), [1024]), "test")
    assert "arXiv 2407.21783" in text and "checkpoint every 30 min" in text
    assert [line.split("|")[2].strip() for line in text.splitlines() if "| 1,024" in line] == [
        "c4stream",
        "watchdog",
        "nccl-ras",
    ]
