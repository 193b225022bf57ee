"""The pipeline rows of the quality benchmark: the suite's coverage, the trace cache,
and ``detect_row`` (one run through ``c4stream detect``'s core on a given input)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import msgspec
import pytest

from bench import bench_quality as bq
from bench.scenarios import PIPELINE_GROUPS, PIPELINE_STEPS, build_shape, pipeline_suite

pytestmark = pytest.mark.timeout(120)


def test_the_suite_covers_every_class_on_every_step_and_size() -> None:
    suite = pipeline_suite()
    assert len(suite) >= 100
    cells = Counter((s.group, s.step_s) for s in suite)
    assert set(cells) == {(g.name, st) for g in PIPELINE_GROUPS for st in PIPELINE_STEPS}
    assert {s.config.gpus for s in suite} == {128, 256, 512, 1024, 2048}
    assert sum(1 for s in suite if not s.config.faults) >= 50  # benign runs
    for s in suite:
        cfg = s.config
        assert cfg.schedule == "1f1b" and cfg.dp_mode == "zero" and cfg.pp >= 4
        for f in cfg.faults:
            # the fault starts after the learning stretch, or at the first collective
            assert f.start_s == 0 or f.start_s >= max(20.0, 6 * s.step_s)
            assert cfg.duration_s > f.start_s + 4 * s.step_s
    quick = pipeline_suite(quick=True)
    assert {s.step_s for s in quick} == {1.0, 10.0} and len(quick) < 40


def test_a_slow_nic_in_a_two_host_ring_and_a_pipeline_link() -> None:
    group = next(g for g in PIPELINE_GROUPS if g.pair_ring)
    sc = build_shape(group, 10.0, seed=1, gpus=256)
    assert sc.config.hosts_per_stage == 2 and sc.config.gpus == 256
    link = next(g for g in PIPELINE_GROUPS if g.kind == "slow_link")
    for seed in range(6):
        f = build_shape(link, 1.0, seed, 128).config.faults[0]
        assert abs(f.peer_host - f.host) == 4  # the next or previous stage, same replica


def _tiny(name: str, **kw: object) -> bq.ShapeScenario:
    group = next(g for g in PIPELINE_GROUPS if g.name.startswith(name))
    sc = build_shape(group, 1.0, seed=0, gpus=64)  # 8 hosts, 2 per stage
    return msgspec.structs.replace(sc, config=msgspec.structs.replace(sc.config, **kw))


def test_traces_are_cached_by_config_and_simulator(tmp_path: Path) -> None:
    sc = _tiny("benign: bubbles", duration_s=4)
    path, sim_s = bq.trace_for(sc, tmp_path)
    assert path.exists() and sim_s > 0
    assert path.read_bytes()[:2] == b"\x1f\x8b"  # gzip, as its name says
    again, sim_again = bq.trace_for(sc, tmp_path)
    assert again == path and sim_again == 0.0
    other, _ = bq.trace_for(msgspec.structs.replace(sc, config=msgspec.structs.replace(
        sc.config, seed=5)), tmp_path)  # fmt: skip
    assert other != path


def test_detect_row_scores_one_run_on_any_input(tmp_path: Path) -> None:
    sc = _tiny("rank_hang", duration_s=40)
    trace, _ = bq.trace_for(sc, tmp_path)
    row = bq.detect_row(sc, trace)
    assert row.input == "raw" and row.gpus == 64 and row.events > 10_000
    assert len(row.faults) == 1 and row.faults[0].fault_id.startswith("f0-rank_hang")
    # an extra input kind is one more entry of INPUTS: its rows print beside raw
    bq.INPUTS["copy"] = lambda sc, p: p
    try:
        runs = bq.run_pipeline_suite([sc], tmp_path, ("raw", "copy"))
    finally:
        del bq.INPUTS["copy"]
    assert [r.input for r in runs] == ["raw", "copy"]
    assert runs[0].faults == runs[1].faults == row.faults
    table = bq.shape_rows(runs)
    assert [t[1] for t in table] == ["raw", "copy"]
    assert table[0][4] in ("0/1", "1/1")


def test_a_degrading_nic_latency_counts_from_the_threshold(tmp_path: Path) -> None:
    from producers.simulator import ground_truth

    sc = _tiny("NIC 1.0")
    f = ground_truth(sc.config).faults[0]
    assert f.threshold_us is not None and f.threshold_us > f.start_us
    assert sc.config.duration_s * 1e6 + f.start_us - f.threshold_us > 0


def test_a_runs_log_keeps_each_run_and_resumes(tmp_path: Path) -> None:
    """Each run is appended to the log as it ends; a second call takes it from there
    (same scores, nothing judged again)."""
    sc = _tiny("benign: bubbles", duration_s=4)
    log = tmp_path / "runs.jsonl"
    first = bq.run_pipeline_suite([sc], tmp_path, ("raw",), 1, log)
    assert len(log.read_bytes().splitlines()) == 1
    again = bq.run_pipeline_suite([sc], tmp_path / "empty-cache", ("raw",), 1, log)
    assert again == first and not (tmp_path / "empty-cache").exists()


def test_log_only_prints_the_runs_in_the_log_and_runs_nothing(tmp_path: Path) -> None:
    sc = _tiny("benign: bubbles", duration_s=4)
    log = tmp_path / "runs.jsonl"
    assert bq.run_pipeline_suite([sc], tmp_path, ("raw",), 1, log, run_missing=False) == []
    assert not log.read_bytes()  # nothing was run
