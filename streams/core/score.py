"""Score isolation commands against a simulator's ground truth (quality bar, bench, demo).

A fault is *found* by the first non-``alert_only`` command of the expected fault class
on the right host (and GPU / NIC / peer host where the fault names one) at or after
the fault's start; its latency is that command's ``ts_us`` minus the start. Any other
non-``alert_only`` command is a *false isolation*.

>>> from streams.commands import IsolationCommand
>>> truth = {"faults": [{"id": "f0", "kind": "straggler", "expected_fault": "straggler",
...          "host": "node-005", "gpu": 3, "start_us": 0, "severity": 1.3}]}
>>> cmd = IsolationCommand(id="c", ts_us=12_000_000, job="j", host="node-005", gpu=3,
...                        fault="straggler", action="cordon", confidence=0.9, reason="r",
...                        evidence={})
>>> r = score_commands([cmd], truth)
>>> r.faults[0].found, r.faults[0].latency_s, r.false_isolations
(True, 12.0, 0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streams.commands import IsolationCommand

__all__ = ["FaultResult", "Score", "score_commands"]


@dataclass(slots=True)
class FaultResult:
    id: str
    kind: str
    expected: str
    host: str
    found: bool
    latency_s: float | None
    command_id: str | None = None


@dataclass(slots=True)
class Score:
    faults: list[FaultResult] = field(default_factory=list)
    false_isolations: int = 0
    false_commands: list[IsolationCommand] = field(default_factory=list)

    @property
    def all_found(self) -> bool:
        return all(f.found for f in self.faults)


def _matches(cmd: IsolationCommand, f: Mapping[str, Any]) -> bool:
    if cmd.fault != f["expected_fault"] or cmd.host != f["host"]:
        return False
    for k in ("gpu", "nic", "peer_host"):
        want = f.get(k)
        if want is None:
            continue
        if f["expected_fault"] == "noncomm_hang" and k == "gpu" and f["kind"] == "host_down":
            continue
        if getattr(cmd, k) != want:
            return False
    return True


def score_commands(commands: Sequence[IsolationCommand], truth: Any) -> Score:
    """Match commands with the faults of ``truth`` (a GroundTruth or its JSON dict)."""
    gt = truth if isinstance(truth, Mapping) else msgspec.to_builtins(truth)
    iso = [c for c in commands if c.action != "alert_only"]
    used: set[int] = set()
    out = Score()
    for f in gt.get("faults", []):
        hit = None
        for i, c in enumerate(iso):
            if i not in used and c.ts_us >= f["start_us"] and _matches(c, f):
                hit = i
                break
        if hit is not None:
            used.add(hit)
            c = iso[hit]
        out.faults.append(
            FaultResult(
                id=f.get("id", ""),
                kind=f["kind"],
                expected=f["expected_fault"],
                host=f["host"],
                found=hit is not None,
                latency_s=round((c.ts_us - f["start_us"]) / 1e6, 1) if hit is not None else None,
                command_id=c.id if hit is not None else None,
            )
        )
    out.false_commands = [c for i, c in enumerate(iso) if i not in used]
    out.false_isolations = len(out.false_commands)
    return out
