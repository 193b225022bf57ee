"""A detector that wraps any river anomaly model on per-rank window features.

Per window, every rank of the communicator gets a feature vector measured against its
peers of that window (all in [0, 1], as ``anomaly.HalfSpaceTrees`` expects):

- ``lateness``: mean log of (peers' median kernel time / its own), clipped to [0, 1] —
  in a synchronous collective the late arriver waits least;
- ``last_frac``: the fraction of collectives in which it had the shortest kernel time;
- ``exec_ratio``: its mean kernel time over the median rank's, halved and clipped.

The model (a ``river.anomaly`` class named in ``[worker.detect.river]``) is trained on
the last ``history_windows`` windows' vectors and scores the current ones; a rank whose
score reaches ``threshold`` and whose peers waited at least ``min_peer_time_x`` longer
than it in most collectives is reported as a straggler (the model ranks anomalies, the
physics of a collective keeps jitter out).

Checkpoints hold the feature history, never the model: a river model can only be
saved by pickling it, which a checkpoint read from Kafka must never need. The model is
rebuilt from the history (same seed, same order) every judged window, so a restored
detector scores exactly like one that never stopped.

>>> from streams.core.config import DetectConfig
>>> d = RiverDetector(DetectConfig(detectors=["river"]))
>>> type(d.template).__name__
'HalfSpaceTrees'
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, ClassVar

import msgspec
import numpy as np

from streams.core import checkpoint as ck
from streams.core.config import DetectConfig, RiverConfig
from streams.core.detector import Batch, CommView, Output, Window
from streams.core.findings import Finding, RiverEvidence
from streams.core.straggler import (
    AlignerState,
    SeqAligner,
    aligner_from_state,
    aligner_state,
    migrate_aligner_1,
    pair_note,
    wait_share,
)

if TYPE_CHECKING:
    from river.base import AnomalyDetector

__all__ = ["FEATURES", "RiverDetector", "make_model"]

FEATURES = ("lateness", "last_frac", "exec_ratio")


def make_model(cfg: RiverConfig) -> AnomalyDetector:
    """A fresh model of the configured ``river.anomaly`` class; ``ValueError`` otherwise.

    >>> make_model(RiverConfig(model="LODA", params={"n_bins": 8}))  # doctest: +ELLIPSIS
    LODA (...)
    >>> make_model(RiverConfig(model="LODA"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: [worker.detect.river] params for LODA: ... argument 'window_size'
    """
    # imported here, when a river detector is built: river.anomaly pulls in scipy.stats
    # (~2 s), which the other detectors and `c4stream detect` on a snapshot never need
    from river import anomaly

    cls = getattr(anomaly, cfg.model)  # RiverConfig checked it names a detector class
    params = dict(cfg.params)
    if "seed" in inspect.signature(cls).parameters:
        params.setdefault("seed", cfg.seed)
    try:
        return cls(**params)
    except TypeError as err:
        raise ValueError(f"[worker.detect.river] params for {cfg.model}: {err}") from None


class _RiverState(msgspec.Struct, array_like=True):
    aligner: AlignerState
    history: list[ck.Array]
    """Per past window, (ranks, features) float32, oldest first."""


class RiverDetector:
    """Stragglers by a river anomaly model over per-rank window features."""

    name: ClassVar[str] = "river"
    _SCHEMA: ClassVar[int] = 2
    """2: the aligner keeps its squared waits (the effect-size bar)."""

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.template = make_model(config.river)
        self.aligner = SeqAligner(0, config.seq_ring, config.min_present_frac)
        self.history: list[np.ndarray] = []

    def grow(self, nranks: int) -> None:
        self.aligner.grow(nranks)
        self.history = [
            np.vstack([h, np.full((nranks - h.shape[0], len(FEATURES)), np.nan, np.float32)])
            if h.shape[0] < nranks
            else h
            for h in self.history
        ]

    def learn(self, view: CommView, batch: Batch) -> None:
        if batch.rank.size:
            x = batch.exec_us.astype(np.float32)
            self.aligner.insert(batch.rank, batch.seq, x, view.now, batch.distinct)

    def tick(self, view: CommView) -> Output:
        return []

    def close_window(self, view: CommView, window: Window) -> Output:
        out: Output = []
        if window.learn:
            self.aligner.close_due(window.end)
            a = self.aligner
            if window.judge and a.n == 2 and view.p2p:  # a pipeline pair: its note
                span = window.end - window.start
                period = span / a.window_n_seqs if a.window_n_seqs else 0.0
                out = pair_note(view, a, window.start, window.end, period)
            feats = self._features()
            if feats is not None:
                if window.judge and self.history:
                    out += self._judge(view, feats, window)
                self.history.append(feats)
                del self.history[: -self.config.river.history_windows]
        self.aligner.reset_window()
        return out

    def dump(self) -> bytes:
        st = _RiverState(aligner_state(self.aligner), [ck.pack(h) for h in self.history])
        return ck.encode(self.name, self._SCHEMA, st)

    @classmethod
    def load(cls, data: bytes, config: DetectConfig) -> RiverDetector:
        st = ck.decode(data, cls.name, {cls._SCHEMA: _RiverState}, {1: migrate_aligner_1})
        d = cls(config)
        d.aligner = aligner_from_state(st.aligner, config)
        d.history = [ck.unpack(h) for h in st.history]
        if any(h.shape != (d.aligner.n, len(FEATURES)) for h in d.history):
            raise ck.CheckpointError("river state: feature history does not fit the ranks")
        return d

    def nbytes(self) -> int:
        return self.aligner.nbytes() + sum(h.nbytes for h in self.history) + 300

    # ------------------------------------------------------------ judging
    def _features(self) -> np.ndarray | None:
        """(ranks, features) of this window; NaN rows for ranks without collectives."""
        a, cfg = self.aligner, self.config
        if a.window_n_seqs < cfg.straggler_min_seqs:
            return None
        n_seq = np.maximum(a.n_seq, 1)
        seen = a.n_seq >= cfg.straggler_min_seqs
        lat = np.clip(a.lat_sum / n_seq, 0.0, 1.0)
        last = a.n_last / n_seq
        mean_exec = a.exec_sum / n_seq
        med = float(np.median(mean_exec[seen])) if seen.any() else 0.0
        ratio = np.clip(mean_exec / med / 2.0, 0.0, 1.0) if med > 0 else np.zeros(a.n)
        f = np.stack([lat, last, ratio], axis=1).astype(np.float32)
        f[~seen] = np.nan
        return f

    def _judge(self, view: CommView, feats: np.ndarray, window: Window) -> Output:
        rcfg = self.config.river
        model = self.template.clone()
        for h in self.history:  # oldest first: the same order after a restore
            for row in h[np.isfinite(h).all(axis=1)].tolist():
                model.learn_one(dict(zip(FEATURES, row, strict=True)))
        a = self.aligner
        n_seq = np.maximum(a.n_seq, 1)
        peer_x = np.exp(a.lat_sum / n_seq)
        frac = a.n_last / n_seq
        # the model ranks; the bar every straggler detector meets decides: the wait the
        # rank causes is, with confidence, a clear share of the step (a static spread of
        # about 1 % between healthy GPUs never is)
        cfg = self.config
        span = window.end - window.start
        period = span / a.window_n_seqs if a.window_n_seqs else 0.0
        share = wait_share(a.n_seq.astype(np.float64), a.late_us_sum, a.late_us_sq, period,
                           cfg.straggler_confidence_z)  # fmt: skip
        cand = np.flatnonzero(
            np.isfinite(feats).all(axis=1) & (peer_x >= rcfg.min_peer_time_x) & (frac >= 0.5)
            & (share >= cfg.straggler_min_share) & (period > 0)
        )  # fmt: skip
        out: Output = []
        for r in cand.tolist():
            row = [float(v) for v in feats[r]]
            score = min(
                1.0, max(0.0, float(model.score_one(dict(zip(FEATURES, row, strict=True)))))
            )
            if score < rcfg.threshold:
                continue
            reason = (
                f"{view.who(r)} scored {score:.2f} on {rcfg.model} over its window features "
                f"(lateness {row[0]:.2f}, last in {frac[r]:.0%} of {int(a.n_seq[r])} "
                f"collectives; its peers spent {peer_x[r]:.2f}x its kernel time, "
                f"{share[r]:.0%} of the step or more)."
            )
            ev = RiverEvidence(
                collectives=int(a.n_seq[r]),
                last_frac=round(float(frac[r]), 3),
                peer_time_x=round(float(peer_x[r]), 3),
                late_ms=round(float(a.late_us_sum[r] / n_seq[r]) / 1e3, 2),
                position=r,
                step_share=round(float(share[r]), 4),
                model=rcfg.model,
                anomaly_score=round(score, 3),
                features=[round(v, 4) for v in row],
            )
            out.append(Finding("straggler", r, score, reason, window.start, window.end, ev, [r]))
        return out
