"""Flight Recorder snapshots in the worker: the exporter publishes every rank's dump of
one moment as the messages of one snapshot (header ``c4-fr-snapshot``,
:mod:`producers.formats.fr_wire`), with the time it saw each dump whole as its dump
time; the worker puts the parts back together and judges the snapshot as a whole
(:func:`streams.core.snapshot.judge_snapshot`, as ``c4stream detect`` does a dump
directory), never as stream events (a dump is one moment, not a window).

A snapshot's finding is corroborated when its host is in two of the snapshot's groups
(the dumps agree on who it is), or by the stream's rule; else it is alert-only."""

from __future__ import annotations

import logging
from collections.abc import Callable

from producers.columnar import ColumnBlock, table_events
from producers.formats.fr_dump import FlightRecorderError
from producers.formats.fr_wire import SnapshotAssembler
from streams.app.admission import contract_problem
from streams.app.deadletter import Record, dead_letter
from streams.app.runner import Output
from streams.app.trust import alert_only_unless_trusted
from streams.core.config import DetectConfig
from streams.core.snapshot import judge_snapshot
from streams.verdicts import Verdict

__all__ = ["SnapshotIntake"]

log = logging.getLogger(__name__)


class SnapshotIntake:
    """Assembles and judges the snapshots of one worker (at most ``max_pending``
    incomplete ones wait; the oldest is dropped beyond, counted and logged)."""

    def __init__(self, detect: DetectConfig, max_pending: int = 64) -> None:
        self.detect = detect
        self.assembler = SnapshotAssembler(max_pending)
        self.judged = 0
        self.uncorroborated = 0

    def take(
        self,
        rec: Record,
        block: ColumnBlock,
        k: int,
        out: Output,
        lonely: Callable[[Verdict], str | None],
        move_clock: Callable[[tuple[int, str], int], None],
    ) -> bool:
        """Message ``k`` of the block, a part of a snapshot: dead-lettered with the reason
        (False), kept until its snapshot is whole, or its snapshot judged into ``out``.
        ``lonely``: the stream's corroboration rule (why nobody vouches, or None);
        ``move_clock``: moves one of the router's lane clocks on to the snapshot's time
        (its job's time, as offline: the watermark then lets the correlator judge its
        verdicts)."""
        s, e = int(block.starts[k]), int(block.starts[k + 1])
        problem = contract_problem(block, s, e)
        if problem is not None:
            out.deadletters.append(dead_letter(rec, f"event breaks the contract: {problem}"))
            return False
        dropped = self.assembler.dropped
        try:
            got = self.assembler.add(rec.snapshot or b"", table_events(block.batch.slice(s, e - s)))
        except FlightRecorderError as err:
            out.deadletters.append(dead_letter(rec, f"bad Flight Recorder snapshot: {err}"))
            return False
        if self.assembler.dropped > dropped:
            log.warning("an incomplete Flight Recorder snapshot was dropped (%d waiting at most)",
                        self.assembler.max_pending)  # fmt: skip
        if got is None:
            return True
        events, facts = got
        groups: dict[str, set[str]] = {}
        for ev in events:
            groups.setdefault(ev.comm, set()).add(ev.host)

        def alone(v: Verdict) -> str | None:
            return None if sum(v.host in h for h in groups.values()) >= 2 else lonely(v)

        verdicts = judge_snapshot(events, self.detect, facts)
        verdicts, n = alert_only_unless_trusted(verdicts, None, alone)
        self.judged += 1
        self.uncorroborated += n
        out.concluded(verdicts, max(ev.ts_us for ev in events))
        for ev in events:
            move_clock((rec.partition, ev.job), ev.ts_us)
        return True
