"""Pipeline schedules: the order in which one stage runs its microbatches.

A pipeline of ``P`` stages, each rank holding ``v`` model chunks (``v = 1`` for 1F1B),
is a chain of ``P * v`` *virtual stages*; chunk ``c`` of stage ``s`` is virtual stage
``c * P + s``. A step of one stage is ``(phase, chunk, microbatch)`` with phase ``"F"``
(forward) or ``"B"`` (backward). Forward of virtual stage ``k`` needs the activations
of ``k - 1``; backward of ``k`` needs the gradient of ``k + 1`` — those are the
pipeline's Send/Recv transfers (:func:`transfers_of`).

- 1F1B (PipeDream-flush, Megatron-LM's default): stage ``s`` runs ``P - s - 1``
  warm-up forwards, then alternates one forward and one backward, then cools down
  with the remaining backwards.
- Interleaved 1F1B (Megatron-LM's virtual pipeline): the same with ``v`` chunks per
  rank, microbatches taken ``P`` at a time per chunk, and ``2 (P - s - 1) + (v - 1) P``
  warm-up forwards.

>>> [f"{p}{m}" for p, _, m in one_f_one_b(stage=0, stages=3, microbatches=4)]
['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
>>> [f"{p}{m}" for p, _, m in one_f_one_b(stage=2, stages=3, microbatches=4)]
['F0', 'B0', 'F1', 'B1', 'F2', 'B2', 'F3', 'B3']
>>> [f"{p}{c}.{m}" for p, c, m in interleaved(stage=1, stages=2, microbatches=2, chunks=2)]
['F0.0', 'F0.1', 'F1.0', 'B1.0', 'F1.1', 'B1.1', 'B0.0', 'B0.1']
"""

from __future__ import annotations

__all__ = ["Step", "Transfer", "interleaved", "one_f_one_b", "program", "transfers_of"]

Step = tuple[str, int, int]
"""(phase "F" or "B", chunk, microbatch)."""

Transfer = tuple[str, int, int]
"""("f", from virtual stage, microbatch): activations to virtual stage + 1; ("b", from
virtual stage, microbatch): gradients to virtual stage - 1."""


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Step]:
    """The 1F1B order of one stage."""
    warm = min(stages - stage - 1, microbatches)
    out: list[Step] = [("F", 0, m) for m in range(warm)]
    f, b = warm, 0
    while f < microbatches:
        out.append(("F", 0, f))
        out.append(("B", 0, b))
        f, b = f + 1, b + 1
    out.extend(("B", 0, m) for m in range(b, microbatches))
    return out


def _chunk_step(k: int, stages: int, chunks: int, forward: bool) -> tuple[int, int]:
    """(chunk, microbatch) of the k-th forward (or backward) step of an interleaved stage."""
    group, within = divmod(k, stages * chunks)
    chunk = within // stages
    if not forward:
        chunk = chunks - 1 - chunk
    return chunk, group * stages + within % stages


def interleaved(stage: int, stages: int, microbatches: int, chunks: int) -> list[Step]:
    """The interleaved 1F1B order of one stage (``microbatches`` a multiple of ``stages``)."""
    total = microbatches * chunks
    warm = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    out: list[Step] = []
    for k in range(warm):
        out.append(("F", *_chunk_step(k, stages, chunks, True)))
    for i in range(total - warm):
        out.append(("F", *_chunk_step(warm + i, stages, chunks, True)))
        out.append(("B", *_chunk_step(i, stages, chunks, False)))
    for k in range(total - warm, total):
        out.append(("B", *_chunk_step(k, stages, chunks, False)))
    return out


def program(schedule: str, stage: int, stages: int, microbatches: int, chunks: int) -> list[Step]:
    """The steps of one stage under ``schedule`` ("1f1b" or "interleaved")."""
    if schedule == "interleaved":
        return interleaved(stage, stages, microbatches, chunks)
    return one_f_one_b(stage, stages, microbatches)


def transfers_of(
    step: Step, stage: int, stages: int, chunks: int
) -> tuple[Transfer | None, Transfer | None]:
    """The transfer a step waits for (input) and the one it sends (output), or None.

    >>> transfers_of(("F", 0, 3), stage=1, stages=4, chunks=1)
    (('f', 0, 3), ('f', 1, 3))
    >>> transfers_of(("B", 0, 3), stage=3, stages=4, chunks=1)
    (None, ('b', 3, 3))
    """
    phase, chunk, m = step
    k = chunk * stages + stage
    last = stages * chunks - 1
    if phase == "F":
        return (("f", k - 1, m) if k > 0 else None), (("f", k, m) if k < last else None)
    return (("b", k + 1, m) if k < last else None), (("b", k, m) if k > 0 else None)
