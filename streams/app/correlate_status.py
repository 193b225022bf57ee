"""What agent ``correlate``'s watermarks look like, for ``status.json``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streams.app.correlate_runner import CorrelatorRunner

__all__ = ["STATUS_JOBS", "describe", "listed"]

STATUS_JOBS = 1000
"""Jobs (or lanes) ``status.json`` lists at most per section: it is written every tick,
and at 20,000 jobs the whole list was ~2.4 MB of JSON, a tenth of a flooded worker's
CPU. Beyond, the first in order (those holding verdicts first) and a count of the rest."""


def listed(keys: list, first: set | None = None) -> tuple[list, int]:
    """At most :data:`STATUS_JOBS` of ``keys`` (sorted), those in ``first`` before the
    rest; and how many were left out.

    >>> keys, left = listed(list(range(1002)), first={1001})
    >>> len(keys), left, keys[-1], 999 in keys
    (1000, 2, 1001, False)
    """
    if len(keys) <= STATUS_JOBS:
        return keys, 0
    pick = [k for k in keys if first and k in first][:STATUS_JOBS]
    seen = set(pick)
    pick += [k for k in keys if k not in seen][: STATUS_JOBS - len(pick)]
    return sorted(pick), len(keys) - len(pick)


def describe(runner: CorrelatorRunner) -> dict[str, Any]:
    """Per verdicts partition and job: the watermark, held verdicts and each events
    partition's clock / seconds since heard / seconds caught up."""
    now = runner.wall()
    out: dict[str, Any] = {}
    for q, marks in runner.marks.items():
        lanes = runner.lanes.get(q, {})
        pending = runner.pending.get(q, {})
        jobs, left = listed(
            sorted({j for _, j in lanes} | set(pending)), {j for j, h in pending.items() if h}
        )
        keep = set(jobs)
        by_job: dict[str, list[tuple[int, Any]]] = {}  # the listed jobs' lanes, once
        for (p, j), lm in lanes.items():
            if j in keep:
                by_job.setdefault(j, []).append((p, lm))
        for per_job in by_job.values():
            per_job.sort(key=lambda x: x[0])
        out[str(q)] = {
            "jobs_not_listed": left,
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
