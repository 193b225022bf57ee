"""The worker process runs the garbage collector at its configured threshold, with its
start-up objects frozen (a full pass walks the heap: ~12% of a worker's CPU measured at
Python's default threshold)."""

from __future__ import annotations

import gc
from pathlib import Path

from streams.app.faust_app import make_app
from streams.app.settings import KafkaConfig, WorkerConfig


def test_make_app_sets_the_collector_threshold_and_freezes_start_up_objects(
    tmp_path: Path,
) -> None:
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    try:
        cfg = WorkerConfig(kafka=KafkaConfig(bootstrap="127.0.0.1:9"), workdir=str(tmp_path),
                           gc_gen0_threshold=12_345)  # fmt: skip
        make_app(cfg)
        assert gc.get_threshold() == (12_345, *before[1:])
        assert gc.get_freeze_count() > frozen
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
