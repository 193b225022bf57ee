"""``c4stream detect`` raises the collector's first threshold for the length of a run
and undoes it after (a process-wide setting must not outlive the call)."""

from __future__ import annotations

import gc
from pathlib import Path

from c4base.collector import GEN0_THRESHOLD
from producers.traces import BadLine
from streams.detect import run_detect


def test_detect_tunes_the_collector_during_a_run_only(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"broken": 1}\n')
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    during: list[tuple[tuple[int, ...], int]] = []

    def bad(_: BadLine) -> None:  # called while the run goes on
        during.append((gc.get_threshold(), gc.get_freeze_count()))

    assert run_detect([trace], tmp_path / "out.jsonl", on_bad=bad).n_bad == 1
    ((threshold, frozen_during),) = during
    assert threshold == (GEN0_THRESHOLD, *before[1:])
    assert frozen_during > 0 if frozen == 0 else frozen_during == frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


def test_a_process_that_froze_objects_keeps_them_frozen(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    kept = [object() for _ in range(3)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        run_detect([trace], tmp_path / "out.jsonl")
        # Frozen objects can still be freed by their last reference going (a thread of an
        # earlier test ending: 3 of 579,864 in one run); an unfreeze would leave none, a
        # second freeze would add the run's objects.
        assert frozen - 1000 < gc.get_freeze_count() <= frozen and kept
    finally:
        gc.unfreeze()
