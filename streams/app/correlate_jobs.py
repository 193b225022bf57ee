"""Where agent ``correlate`` keeps a verdicts partition's correlator state: one
checkpoint per job (issue 22), under a key of the partition and the job.

A partition's host correlator holds every job whose verdicts land there; each part of
its state is keyed by job (:mod:`streams.core.correlate_state`). Behind a decision, and
every N verdicts or S seconds, only the jobs whose state changed are written, each its
own table record (a job of 256 GPUs: tens of kB) — not the partition's whole state (at
391 jobs on one partition 16.6 MB, ~1 s to encode, behind every decision of any job).
A job's part is read back the first time the restarted correlator meets the job (a
verdict or a watermark of it).

**The form before** (one record per partition under ``correlator-<p>``, schema 2 and
before) is still read once, when the partition is first served: its jobs become the
correlator's, and right away each is written under its own key, then an empty
correlator under the old key, in that order (so a crash in between leaves per-job
records equal to the old one, never older): it is read once, never again.

**Held verdicts handed off.** Verdicts read but not yet judged (their job's watermark
has not passed them) are committed with the rest of the consumer's batch. When their
partition is revoked, they are written under :func:`held_key` instead of being judged
there and then (out of event-time order: one correlator and several then decided
differently); the next owner takes them back into its heap the first time it serves the
partition, and writes an empty hand-off at once, so that they are taken back once.
"""

from __future__ import annotations

import hashlib

import msgspec

from streams.app.deadletter import Record
from streams.app.engine import CorrelatorLike

__all__ = ["HeldVerdict", "JobPart", "decode_held", "encode_held", "held_key", "job_key",
           "migration", "partition_key"]  # fmt: skip

HELD_SCHEMA = 1


def partition_key(partition: int) -> bytes:
    """The key of a partition's whole correlator (the form before per-job records)."""
    return f"correlator-{partition}".encode()


def job_key(partition: int, job: str) -> bytes:
    """The key of one job's part on ``partition``: the job id hashed (any string is a
    job id; a NUL in a key would collide with the chunk keys of
    :func:`streams.app.checkpoint.chunk_keys`); the record itself names its job, and a
    record of another job under this key is refused."""
    digest = hashlib.sha256(job.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return f"correlator-{partition}/job-{digest}".encode()


class JobPart:
    """One job's part of a partition's correlator, as the checkpoint cycle sees it."""

    __slots__ = ("cor", "job")

    def __init__(self, cor: CorrelatorLike, job: str) -> None:
        self.cor = cor
        self.job = job

    def to_bytes(self) -> bytes:
        return self.cor.to_bytes(self.job)


def migration(
    partition: int, cor: CorrelatorLike, jobs: list[str], empty: CorrelatorLike
) -> list[tuple[int, bytes, bytes]]:
    """The records that move a partition's whole correlator of the form before to one
    record per job: each job's part, then ``empty`` under the old key (last)."""
    out = [(partition, job_key(partition, j), cor.to_bytes(j)) for j in jobs]
    return [*out, (partition, partition_key(partition), empty.to_bytes())]


class HeldVerdict(msgspec.Struct, array_like=True, frozen=True):
    """A verdict read but not judged, as handed to the partition's next owner."""

    end: int
    """The event-time slice end it is judged after."""
    clock_us: int | None
    topic: str
    offset: int
    value: bytes
    """The verdict as it was on ``c4.verdicts`` (decoded again, never unpickled)."""

    @classmethod
    def of(cls, end: int, rec: Record) -> HeldVerdict:
        return cls(end, rec.clock_us, rec.topic, rec.offset, rec.value)


class _HandOff(msgspec.Struct, frozen=True):
    schema: int
    partition: int
    held: list[HeldVerdict]


def held_key(partition: int) -> bytes:
    """The key of a verdicts partition's held verdicts, handed off at a revoke."""
    return f"held-verdicts-{partition}".encode()


def encode_held(partition: int, held: list[HeldVerdict]) -> bytes:
    return msgspec.msgpack.encode(_HandOff(HELD_SCHEMA, partition, held))


def decode_held(partition: int, data: bytes) -> list[HeldVerdict]:
    """The held verdicts of ``partition``; ``ValueError`` for another schema or partition
    (msgspec's decode errors are ValueErrors too).

    >>> v = HeldVerdict(500_000, None, "c4.verdicts", 7, b"{}")
    >>> decode_held(3, encode_held(3, [v])) == [v]
    True
    """
    off = msgspec.msgpack.decode(data, type=_HandOff)
    if off.schema != HELD_SCHEMA or off.partition != partition:
        raise ValueError(f"held verdicts of schema {off.schema}, partition {off.partition}")
    return off.held
