"""Who corroborates a communicator as evidence against a host (issue 25: two forged
messages about an invented communicator cordoned a healthy host).

With signing on, two hosts that signed messages for a communicator corroborate it (each
host signs only for itself). Without signing, anyone can write any host's name, so the
only evidence is the communicator's *membership*, read against the physics of how a
job's communicators are made: every rank is a process of the job (a GPU of one of its
hosts), and the job's communicators come from splitting its ranks (``ncclCommSplit``:
every rank takes part, so one split gives a family of communicators alike in shape — a
tensor-parallel group per node, a data-parallel group per stage — and the job's world
communicator holds every process). A communicator corroborates its accusation of
``host`` when

- the accused host is a member of another communicator of the job (its process there
  may be another GPU: the worker may not hold, or not have read yet, the communicators
  of the accused's own GPU), and
- its shape (size, and how many of its ranks each host holds) is the shape of another
  communicator of the job, or it holds every process the job's other communicators hold
  (the world communicator).

A forger who invents a communicator inside a known job with real host names but a
shape no sibling has (four ranks, one per host, in a job split two GPUs per host) is
alert-only. What remains: a forger who knows the job's layout and copies a real shape
exactly; signing closes that (docs/security.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["Membership"]

Process = tuple[str, int]
"""(host, GPU; -1 unknown): one process of a job."""


def _members(table: Any) -> tuple[list[Process], int] | None:
    """The processes of a communicator's rank table (ranks whose identity is known) and
    its size; None without a table."""
    if table is None:
        return None
    ix = getattr(table, "host_idx", None)
    if ix is None:  # a table of hosts only (a stand-in detector)
        return [(h, -1) for h in getattr(table, "_host_ix", ())], int(getattr(table, "n", 0))
    hosts = table.hosts
    return [(hosts[h], g) for h, g in zip(ix.tolist(), table.gpu.tolist(), strict=True)
            if h >= 0], int(table.n)  # fmt: skip


def _shape(members: list[Process], n: int) -> tuple[int, tuple[int, ...]]:
    return n, tuple(sorted(Counter(h for h, _ in members).values()))


class Membership:
    """Per worker: the communicators of each job, who signed for each, and the rule."""

    __slots__ = ("by_job", "signers", "_corroborated", "_batch")

    def __init__(self) -> None:
        self.by_job: dict[str, set[str]] = {}
        """job -> its communicators held."""
        self.signers: dict[str, set[str]] = {}
        """Communicator -> hosts whose signed messages reported for it (at most 2 kept)."""
        self._corroborated: set[tuple[str, str]] = set()
        """(communicator, host) found corroborated (cached: it only becomes true)."""
        self._batch: dict[str, dict[str, tuple[set[Process], int]]] = {}
        """job -> communicator -> its processes and size in the last consumer batch
        (:meth:`preview`): a batch is judged as one, whatever the order of its messages."""

    def preview(self, block: Any) -> None:
        """Know the communicators of a consumer batch's block before any of it is judged:
        a catch-up batch holds whole partitions one after another, and the verdicts of
        the first were judged before the communicators of the accused's other GPUs (in a
        later partition of the same batch) were read. Kept until the next batch."""
        self._batch.clear()
        if block is None or block.batch.num_rows == 0:
            return
        import numpy as np
        import pyarrow.compute as pc

        # rows not admitted yet: any value may be there (codes, not the values, are keyed)
        hosts, host_names = block.codes("host")
        gpu = pc.fill_null(block.batch.column("gpu"), -1).to_numpy(zero_copy_only=False)
        gpus, g_ix = np.unique(gpu, return_inverse=True)
        g_n, h_n = len(gpus), len(host_names)
        if len(block.comm_names) * h_n * g_n < 2**62:
            # one int key per (communicator, host, GPU): np.unique on rows is ~10x slower
            key = (block.comm_codes.astype(np.int64) * h_n + hosts) * g_n + g_ix
            uniq, first = np.unique(key, return_index=True)
            parts = [(*divmod(int(k) // g_n, h_n), int(k) % g_n) for k in uniq.tolist()]
        else:
            rows = np.stack([block.comm_codes, hosts, g_ix], 1)
            found, first = np.unique(rows, axis=0, return_index=True)
            parts = [tuple(r) for r in found.tolist()]
        jobs, nranks = block.job_codes[first].tolist(), block.column("nranks")[first].tolist()
        for (c, h, g), j, n in zip(parts, jobs, nranks, strict=True):
            comms = self._batch.setdefault(block.job_names[j], {})
            procs, most = comms.get(block.comm_names[c], (set(), 0))
            procs.add((host_names[h], int(gpus[g])))
            comms[block.comm_names[c]] = (procs, max(most, int(n)))

    def add(self, comm: str, job: str) -> None:
        self.by_job.setdefault(job, set()).add(comm)

    def forget(self, comm: str, job: str | None) -> None:
        self.signers.pop(comm, None)
        comms = self.by_job.get(job) if job is not None else None
        if comms is not None:
            comms.discard(comm)
            if not comms:
                del self.by_job[job]  # type: ignore[arg-type]

    def signed(self, comm: str, signer: bytes | None) -> None:
        if signer is None:
            return
        seen = self.signers.setdefault(comm, set())
        if len(seen) < 2:
            seen.add(signer.decode("utf-8", "replace"))

    def uncorroborated(
        self, comm: str, job: str, host: str, table_of: Callable[[str], Any], signing: bool
    ) -> str | None:
        """Why nobody corroborates ``comm`` as evidence against ``host`` (module doc), or
        None. ``table_of``: a communicator's rank table (None: not held)."""
        if len(self.signers.get(comm, ())) >= 2 or (comm, host) in self._corroborated:
            return None
        batch = self._batch.get(job, {})
        mine = _members(table_of(comm))
        others = [m for c in self.by_job.get(job, ()) if c != comm
                  and (m := _members(table_of(c))) is not None]  # fmt: skip
        others += [(sorted(p), n) for c, (p, n) in batch.items()
                   if c != comm and table_of(c) is None]  # fmt: skip
        why = self._why(mine, others, host)
        if why is None:
            self._corroborated.add((comm, host))
            return None
        signed = " and no second host signed for it" if signing else ""
        return f"communicator {comm[:64]} of job {job[:64]}: {why}{signed}"

    @staticmethod
    def _why(
        mine: tuple[list[Process], int] | None,
        others: list[tuple[list[Process], int]],
        host: str,
    ) -> str | None:
        if mine is None or not others:
            return f"the only one of the job in which this worker saw {host}"
        procs, n = mine
        if host not in {h for h, _ in procs}:
            return f"none of its ranks is on {host}"
        elsewhere = {p for ms, _ in others for p in ms}
        if host not in {h for h, _ in elsewhere}:
            return f"the only one of the job in which this worker saw {host}"
        shape = _shape(procs, n)
        if any(_shape(ms, k) == shape for ms, k in others) or elsewhere <= set(procs):
            return None
        per_host = "/".join(map(str, shape[1]))
        return (
            f"its shape ({n} ranks, {per_host} per host) is that of no other communicator "
            "of the job, nor does it hold all of the job's processes"
        )
