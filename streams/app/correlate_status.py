"""What agent ``correlate``'s watermarks look like, for ``status.json``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streams.app.correlate_runner import CorrelatorRunner

__all__ = ["describe"]


def describe(runner: CorrelatorRunner) -> dict[str, Any]:
    """Per verdicts partition and job: the watermark, held verdicts and each events
    partition's clock / seconds since heard / seconds caught up."""
    now = runner.wall()
    out: dict[str, Any] = {}
    for q, marks in runner.marks.items():
        lanes = runner.lanes.get(q, {})
        by_job: dict[str, list[tuple[int, Any]]] = {}  # once: not all lanes per job
        for (p, j), lm in sorted(lanes.items()):
            by_job.setdefault(j, []).append((p, lm))
        jobs = sorted(set(by_job) | set(runner.pending.get(q, {})))
        out[str(q)] = {
            "deferred": len(runner.deferred.get(q, ())),
            "partitions": {
                str(p): [
                    m.clock_us,
                    round(now - m.heard, 1),
                    None if m.idle_since is None else round(now - m.idle_since, 1),
                ]
                for p, m in sorted(marks.items())
            },
            "jobs": {
                job: {
                    "watermark_us": runner.watermark(now, q, job),
                    "held": len(runner.pending.get(q, {}).get(job, ())),
                    "holding": sorted(
                        p
                        for p, lm in by_job.get(job, ())
                        if now - marks[p].heard < runner.max_hold_s
                        and runner._lane_holds(lm, marks[p], now)
                    ),
                    "clocks": {str(p): lm.clock_us for p, lm in by_job.get(job, ())},
                }
                for job in jobs
            },
        }
    return out
