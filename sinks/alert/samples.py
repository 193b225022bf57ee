"""A realistic sample alert: what ``c4stream alert test`` sends and the target tests render.

>>> n = sample_notification()
>>> n.status, n.severity, n.host, n.commands
('firing', 'critical', 'gpu-node-17', 1)
"""

from __future__ import annotations

from sinks.alert.grouping import Grouper, Observation
from sinks.alert.model import Notification, Status
from streams.commands import IsolationCommand

__all__ = ["sample_command", "sample_notification"]


def sample_command(host: str = "gpu-node-17", *, id: str = "c4-test-1") -> IsolationCommand:
    return IsolationCommand(
        id=id,
        ts_us=1_764_000_000_000_000,
        job="llm-pretrain-7b",
        host=host,
        fault="straggler",
        action="cordon_and_taint",
        confidence=0.97,
        reason=(
            f"{host} GPU 3 arrived last at 96% of allreduce calls in 3 communicators over "
            "60 s; its peers wait 41 ms per step. (c4stream alert test)"
        ),
        evidence={"comms": ["0x7f3a", "0x7f3b", "0x7f3c"], "late_ratio": 0.96},
        gpu=3,
        # Not dry_run: a dry-run command alerts as warning (nothing is acted on).
    )


def sample_notification(status: Status = "firing", *, now: float = 1_764_000_000.0) -> Notification:
    """The sample command as the grouper turns it into a notification (firing or resolved)."""
    g = Grouper(resolve_timeout_s=600.0)
    (firing,) = g.observe(Observation.of_command(sample_command()), now)
    if status == "firing":
        return firing
    (resolved,) = g.expire(now + 600.0)
    return resolved
