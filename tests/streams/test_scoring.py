"""The one scorer (streams/scoring.py) of tests, bench and demo, and one bench run."""

from __future__ import annotations

import msgspec
import pytest

from streams.scoring import Decision, TruthFault, component_ok, outcome, score_run, truth_faults

S = 1_000_000
T0 = 1_750_000_000_000_000

pytestmark = pytest.mark.timeout(60)


def fault(kind: str = "straggler", expected: str = "straggler", **kw) -> TruthFault:
    base = {"id": "f", "kind": kind, "expected_fault": expected, "host": "node-003",
            "start_us": T0 + 20 * S}  # fmt: skip
    return TruthFault(**(base | kw))


def dec(t_s: float, host: str | None = "node-003", fault_: str | None = "straggler",
        action: str = "cordon", **kw) -> Decision:  # fmt: skip
    return Decision(detector="t", ts_us=T0 + int(t_s * S), host=host, fault=fault_,
                    action=action, **kw)  # fmt: skip


def test_time_window_allows_one_second_of_slack() -> None:
    f = fault(gpu=2)
    assert outcome(dec(18.9), f) is None
    assert outcome(dec(19.5), f) == "match"
    s = score_run([dec(19.5, gpu=2)], [f])
    assert s.faults[0].latency_us == 0  # clamped: a decision in the slack is not negative
    assert s.false_isolations == 0  # matched, so not false


def test_host_must_match_and_only_link_faults_accept_the_other_end() -> None:
    slow_nic = fault("slow_nic", "slow_nic", nic="mlx5_1", peer_host="node-004")
    assert outcome(dec(25, "node-004", "slow_nic"), slow_nic) is None
    link = fault("slow_link", "slow_link", nic="mlx5_1", peer_host="node-004")
    assert outcome(dec(25, "node-004", "slow_link"), link) == "match"
    assert outcome(dec(25, "node-003", "slow_link"), link) == "match"
    assert outcome(dec(25, "node-005", "slow_link"), link) is None
    hang = fault("link_hang", "comm_hang", nic="mlx5_1", peer_host="node-004")
    assert outcome(dec(25, "node-004", "comm_hang"), hang) == "match"


def test_straggler_and_noncomm_hang_confusion_is_wrong_class_not_false() -> None:
    f = fault(gpu=2)
    s = score_run([dec(25, fault_="noncomm_hang", gpu=2)], [f])
    fs = s.faults[0]
    assert (fs.detected, fs.localized, fs.wrong_class) == (True, False, True)
    assert fs.latency_us is None and s.false_isolations == 0
    # once also found with the right class, it is no longer "wrong class"
    s2 = score_run([dec(25, fault_="noncomm_hang"), dec(30, gpu=2)], [f])
    assert (s2.faults[0].localized, s2.faults[0].wrong_class) == (True, False)
    assert s2.faults[0].latency_us == 10 * S


def test_other_class_confusions_are_false_isolations() -> None:
    link = fault("slow_link", "slow_link", nic="mlx5_1", peer_host="node-004")
    s = score_run([dec(25, "node-003", "slow_nic", nic="mlx5_1")], [link])
    assert s.false_isolations == 1 and not s.faults[0].detected


def test_hostless_decisions_detect_hangs_without_localizing_them() -> None:
    hang = fault("rank_hang", "noncomm_hang", gpu=1)
    wd = dec(620, host=None, fault_=None, action="restart_job")
    s = score_run([wd], [hang])
    fs = s.faults[0]
    assert (fs.detected, fs.localized, fs.component) == (True, False, False)
    assert fs.latency_us == 600 * S and s.false_isolations == 0
    # ... but not a straggler, and on a healthy run it is a false alarm that kills the job
    assert not score_run([wd], [fault(gpu=1)]).faults[0].detected
    assert score_run([wd], []).false_isolations == 1


def test_only_isolating_actions_count_as_false_isolations() -> None:
    ds = [dec(25, "node-009"), dec(26, "node-009", action="alert_only"), dec(27, "node-001")]
    s = score_run(ds, [])
    assert (s.false_isolations, s.decisions, s.isolating) == (2, 3, 2)


def test_component_per_fault_kind() -> None:
    assert component_ok(dec(25, gpu=2), fault(gpu=2)) is True
    assert component_ok(dec(25, gpu=5), fault(gpu=2)) is False
    assert component_ok(dec(25, fault_="noncomm_hang"), fault("host_down", "noncomm_hang")) is None
    nic = fault("slow_nic", "slow_nic", nic="mlx5_6")
    assert component_ok(dec(25, fault_="slow_nic", nic="mlx5_6"), nic) is True
    assert component_ok(dec(25, fault_="slow_nic", nic="mlx5_5"), nic) is False
    link = fault("slow_link", "slow_link", nic="mlx5_6", peer_host="node-004")
    d = dec(25, "node-004", "slow_link", nic="mlx5_6", peer_host="node-003")
    assert component_ok(d, link) is True
    assert component_ok(msgspec.structs.replace(d, peer_host=None), link) is False
    s = score_run([msgspec.structs.replace(d, gpu=None), dec(30, "node-003", "slow_link")], [link])
    assert s.faults[0].component is True  # any matching decision naming the link


def test_truth_faults_reads_the_simulators_ground_truth() -> None:
    from producers.simulator import FaultSpec, SimConfig, ground_truth

    cfg = SimConfig(hosts=4, faults=[
        FaultSpec(kind="link_hang", host=1, peer_host=2, nic=3, start_s=5)])  # fmt: skip
    (f,) = truth_faults(ground_truth(cfg))
    assert (f.expected_fault, f.host, f.peer_host, f.nic) == ("comm_hang", "node-001",
                                                             "node-002", "mlx5_3")  # fmt: skip
    assert truth_faults(msgspec.to_builtins(ground_truth(cfg))) == [f]


def test_bench_scores_baselines_on_a_simulated_rank_hang() -> None:
    """End to end on a 16-GPU job: the watchdog detects at ~600 s, RAS localizes in ~20 s."""
    from bench.bench_quality import run_scenario
    from bench.scenarios import Scenario
    from producers.simulator import FaultSpec, SimConfig

    cfg = SimConfig(hosts=2, duration_s=625, faults=[
        FaultSpec(kind="rank_hang", host=1, gpu=2, start_s=10)])  # fmt: skip
    sc = Scenario(group="g", kind="rank_hang", seed=0, config=cfg, watch_s=40)
    res = run_scenario(sc, ("watchdog", "nccl-ras"))
    # nccl-ras saw only the first 30 s of the hang, the watchdog ran until it fired
    assert 0 < res.events_watched < res.events
    wd = res.detectors["watchdog"].score.faults[0]
    assert (wd.detected, wd.localized) == (True, False)
    assert 590 * S <= wd.latency_us <= 602 * S
    ras = res.detectors["nccl-ras"]
    assert ras.score.faults[0].localized and ras.score.faults[0].component
    assert 19 * S <= ras.score.faults[0].latency_us <= 23 * S


def test_alert_only_on_the_right_host_is_detected_not_localized() -> None:
    f = fault(gpu=2)
    s = score_run([dec(25, gpu=2, action="alert_only")], [f])
    fs = s.faults[0]
    assert (fs.detected, fs.localized, fs.component) == (True, False, False)
    assert fs.latency_us == 5 * S and s.false_isolations == 0
    s2 = score_run([dec(25, gpu=2, action="alert_only"), dec(28, gpu=2)], [f])
    assert s2.faults[0].localized and s2.faults[0].latency_us == 8 * S


@pytest.mark.parametrize("module", ["bench.baselines", "bench.scenarios", "bench.bench_quality"])
def test_doctests_of_the_quality_bench(module: str) -> None:
    """pytest's doctest collection skips bench/ (``--ignore=bench``), so run them here."""
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_a_crashing_detector_is_reported_and_stopped() -> None:
    from bench.bench_quality import _Slot

    class Boom:
        calls = 0

        def feed(self, events: list) -> list:
            Boom.calls += 1
            raise RuntimeError("kaput")

        def finish(self) -> list:
            raise AssertionError("finish is not called after a crash")

    slot = _Slot(Boom())
    slot.feed([])
    slot.feed([])
    slot.finish()
    assert slot.done and slot.error == "RuntimeError: kaput" and slot.decisions == []
    assert Boom.calls == 1
