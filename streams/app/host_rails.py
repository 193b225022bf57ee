"""The rails that hold across jobs (:class:`HostRails`), and their checkpoint: a job id
is free to invent, so a cap per job alone lets a forger isolate a host once per job."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec

from streams.commands import IsolationCommand
from streams.core import checkpoint as ck

__all__ = ["HostRails"]

log = logging.getLogger(__name__)


class _RailsState(msgspec.Struct, array_like=True):
    """One verdicts partition's share of the rails, as checkpointed (wall epoch seconds:
    the worker's monotonic clock starts again with the process)."""

    acted: list[float]
    hosts: list[tuple[str, float, str]]
    """(host, when, job) of its last isolating command."""


_SCHEMA = 1


class HostRails:
    """Rails that hold across jobs, on the worker's own clock (a job id is free to
    invent, and each job has its own event time): a host isolated for one job is not
    isolated again for another within ``cooldown_s``, and at most ``max_per_hour``
    isolating commands go out per rolling hour whatever their jobs. Beyond, a command
    becomes ``alert_only`` and its reason says why. (The per-job cap and cool-down of
    the correlator still apply within a job.)

    What each verdicts partition's correlator sent is checkpointed with it
    (:meth:`state`, :meth:`load`): a restarted worker, or the one a partition moves to,
    still holds the cap and the cool-downs.

    >>> from streams.commands import IsolationCommand
    >>> cmd = lambda job, host: IsolationCommand(id=job + host, ts_us=1, job=job,
    ...     host=host, fault="straggler", action="cordon_and_taint", confidence=1.0,
    ...     reason="slow.", evidence={})
    >>> r = HostRails(2, 600.0, clock=lambda: 0.0)
    >>> [c.action for c in r.apply([cmd("a", "n1"), cmd("b", "n1"), cmd("c", "n2"),
    ...                             cmd("d", "n3")])]
    ['cordon_and_taint', 'alert_only', 'cordon_and_taint', 'alert_only']
    >>> r.apply([cmd("b", "n1")])[0].reason
    'slow. Not isolated: n1 was isolated for job a 0 s ago (cool-down per host, across jobs).'
    >>> again = HostRails(2, 600.0, clock=lambda: 5.0)
    >>> again.load(0, r.state(0)); again.apply([cmd("e", "n4")])[0].action
    'alert_only'
    """

    def __init__(
        self,
        max_per_hour: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        epoch: Callable[[], float] = time.time,
    ) -> None:
        self.max_per_hour = max_per_hour
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.epoch = epoch
        self._acted: deque[tuple[float, int]] = deque()
        """(when, verdicts partition) of each isolating command of the last hour."""
        self._hosts: dict[str, tuple[float, str, int]] = {}
        """host -> (when, job, verdicts partition) of its last isolating command."""
        self.held = 0

    def apply(self, cmds: list[IsolationCommand], partition: int = 0) -> list[IsolationCommand]:
        """``cmds`` of verdicts partition ``partition``'s correlator, held where a rail says."""
        if not cmds:
            return cmds
        now = self.clock()
        self._expire(now)
        out = []
        for c in cmds:
            if c.action == "alert_only":
                out.append(c)
                continue
            prior = self._hosts.get(c.host)
            why = ""
            if prior is not None and prior[1] != c.job:
                why = (
                    f" Not isolated: {c.host} was isolated for job {prior[1][:64]} "
                    f"{now - prior[0]:.0f} s ago (cool-down per host, across jobs)."
                )
            elif len(self._acted) >= self.max_per_hour:
                why = (
                    f" Not isolated: {len(self._acted)} isolating commands in the last hour "
                    f"across all jobs (cap {self.max_per_hour}, [worker] max_isolations_per_hour)."
                )
            if why:
                self.held += 1
                log.warning("isolation of %s for job %s held:%s", c.host, c.job, why)
                out.append(msgspec.structs.replace(c, action="alert_only", reason=c.reason + why))
                continue
            self._acted.append((now, partition))
            self._hosts[c.host] = (now, c.job, partition)
            out.append(c)
        return out

    def _expire(self, now: float) -> None:
        while self._acted and self._acted[0][0] < now - 3600.0:
            self._acted.popleft()
        for h in [h for h, (t, _, _) in self._hosts.items() if t < now - self.cooldown_s]:
            del self._hosts[h]

    def state(self, partition: int) -> bytes:
        """What ``partition``'s correlator sent within the rails' memory, as a checkpoint
        (versioned msgpack, no pickle)."""
        now = self.clock()
        self._expire(now)
        to_epoch = self.epoch() - now
        st = _RailsState(
            [t + to_epoch for t, q in self._acted if q == partition],
            [(h, t + to_epoch, job) for h, (t, job, q) in self._hosts.items() if q == partition],
        )
        return ck.encode("host_rails", _SCHEMA, st)

    def load(self, partition: int, data: bytes) -> None:
        """:meth:`state` back (``CheckpointError`` for anything else); entries from the
        future (a clock set back, forged bytes) count as now."""
        st = ck.decode(data, "host_rails", {_SCHEMA: _RailsState})
        now = self.clock()
        from_epoch = now - self.epoch()
        acted = [min(t + from_epoch, now) for t in st.acted[: self.max_per_hour]]
        self._acted = deque(sorted([*self._acted, *((t, partition) for t in acted)]))
        for host, t, job in st.hosts:
            t = min(t + from_epoch, now)
            if host not in self._hosts or self._hosts[host][0] < t:
                self._hosts[host] = (t, job, partition)
        self._expire(now)

    def forget(self, partition: int) -> None:
        """Forget ``partition``'s share (revoked: its next owner restores it)."""
        self._acted = deque(x for x in self._acted if x[1] != partition)
        for h in [h for h, x in self._hosts.items() if x[2] == partition]:
            del self._hosts[h]
