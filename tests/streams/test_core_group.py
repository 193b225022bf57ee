"""Communicators judged together (``streams.core.group``) give what each judged alone
gives: the same verdicts in the same order and the same state, for every fault class,
communicators of different sizes in one group, and one that joins mid-run."""

from __future__ import annotations

import msgspec
import pytest

from producers.columnar import decode_arrow, encode_arrow
from producers.events import Event, OpEvent
from producers.simulator import SCENARIOS, FaultSpec, simulate
from streams.core import CommDetector, DetectConfig
from streams.core.group import CommGroup, cut_many, observe_many
from streams.verdicts import encode_verdict

_SLICE_US = 500_000

_BASE = msgspec.structs.replace(SCENARIOS["healthy"], hosts=8, duration_s=44, seed=11)
SIMS = {
    # data-parallel rings of 4 ranks, pipeline pairs of 2, tensor groups of 8
    "sizes": msgspec.structs.replace(_BASE, pp=2, faults=[
        FaultSpec(kind="straggler", host=2, gpu=3, start_s=6, end_s=18, severity=1.6),
        FaultSpec(kind="slow_link", host=1, nic=2, peer_host=2, start_s=8, severity=0.4),
        FaultSpec(kind="rank_hang", host=5, gpu=2, start_s=28),
    ]),
    "network": msgspec.structs.replace(_BASE, faults=[
        FaultSpec(kind="slow_nic", host=4, nic=1, start_s=6, end_s=20, severity=0.4),
        FaultSpec(kind="link_hang", host=6, nic=3, peer_host=7, start_s=28),
    ]),
}  # fmt: skip
FOUND = {"sizes": {"straggler", "slow_link", "noncomm_hang"}, "network": {"slow_nic", "comm_hang"}}


def _slices(sim: str, late_comm_from_s: float) -> list[list[list[Event]]]:
    """The trace cut as the pipeline cuts it: per 0.5 s slice, each communicator's
    events of the slice (in order of first appearance). One communicator is heard only
    from ``late_comm_from_s`` on (it joins mid-run)."""
    batches = [b for b in simulate(SIMS[sim]) if b]
    comms = sorted({b[0].comm for b in batches})
    late = comms[len(comms) // 2]
    t0 = min(b[0].ts_us for b in batches)
    out: dict[int, dict[str, list[Event]]] = {}
    for b in batches:
        if b[0].comm == late and b[0].ts_us < t0 + late_comm_from_s * 1e6:
            continue
        out.setdefault(b[0].ts_us // _SLICE_US, {}).setdefault(b[0].comm, []).extend(b)
    return [list(out[k].values()) for k in sorted(out)]


@pytest.fixture(scope="module", params=sorted(SIMS))
def slices(request: pytest.FixtureRequest) -> tuple[str, list[list[list[Event]]]]:
    return request.param, _slices(request.param, late_comm_from_s=12)


def _run(
    slices: list[list[list[Event]]], grouped: bool, group: CommGroup | None = None,
    cfg: DetectConfig | None = None,
) -> tuple[list[bytes], dict[str, bytes]]:  # fmt: skip
    """Verdicts and final checkpoints, each communicator alone or ``grouped`` (with
    ``group``: the detectors with a grouped pass learn in it)."""
    cfg = cfg or DetectConfig()
    dets: dict[str, CommDetector] = {}
    got: list[bytes] = []
    for part in slices:
        items = []
        for evs in part:
            comm = evs[0].comm
            d = dets.setdefault(comm, CommDetector(comm, cfg))
            items.append((d, decode_arrow(encode_arrow(evs))[0]))
        if grouped:
            verdicts = [v for vs in observe_many(items, group) for v in vs]
        else:
            verdicts = [v for d, c in items for v in d.observe(c)]
        now = max(e.ts_us for evs in part for e in evs)
        verdicts += [v for d in dets.values() for v in d.advance(now)]
        got += [encode_verdict(v) for v in verdicts]
    return got, {c: d.to_bytes() for c, d in dets.items()}


def test_grouped_equals_one_by_one_for_every_fault_class(
    slices: tuple[str, list[list[list[Event]]]],
) -> None:
    sim, slices_ = slices
    sizes = {evs[0].nranks for part in slices_ for evs in part}
    if sim == "sizes":
        assert sizes == {2, 4, 8}, "communicators of different sizes share a group"
    assert max(len(part) for part in slices_) >= 8, "many communicators per slice"
    alone, state_alone = _run(slices_, grouped=False)
    together, state_together = _run(slices_, grouped=True)
    claims = [msgspec.json.decode(v) for v in alone]
    faults = {c["fault"] for c in claims if not c.get("benign", False)}
    assert faults >= FOUND[sim]
    assert together == alone
    assert state_together == state_alone
    group = CommGroup()
    laid_out, state_laid_out = _run(slices_, grouped=True, group=group)
    assert laid_out == alone
    assert state_laid_out == state_alone
    st = group.stragglers
    assert st.n_grouped > 10 * st.n_alone, "the grouped pass does the usual case"
    assert 1 < st.n_layouts < 10, "laid out again only when a communicator joins or grows"
    assert 1 < group.ranks.n_layouts < 10


@pytest.mark.parametrize("ring", [4, 16, 64])
def test_rings_that_wrap_within_a_batch_are_left_to_the_aligner(
    slices: tuple[str, list[list[list[Event]]]], ring: int
) -> None:
    """Small rings: a batch's collectives share rows or find them taken (the aligner
    closes what the full ring pushes out), mixed with batches the group inserts. Some
    ops are lost on the way (a rank absent from a collective: its cell stays empty)."""
    cfg = DetectConfig(seq_ring=ring)

    def kept(k: int, e: Event) -> bool:  # about one op in eleven lost
        return not isinstance(e, OpEvent) or (k * 7 + e.rank) % 11 != 0

    slices_ = [
        [[e for k, e in enumerate(evs) if kept(k, e)] for evs in part] for part in slices[1][:40]
    ]
    alone, state_alone = _run(slices_, grouped=False, cfg=cfg)
    group = CommGroup()
    laid_out, state_laid_out = _run(slices_, grouped=True, group=group, cfg=cfg)
    assert laid_out == alone
    assert state_laid_out == state_alone
    assert group.stragglers.n_alone > 0 or ring == 64  # 64: the default, never wraps here
    assert group.stragglers.n_grouped > 0 or ring == 4


def test_a_communicator_joining_mid_run_is_judged_alike(
    slices: tuple[str, list[list[list[Event]]]],
) -> None:
    slices_ = slices[1]
    comms_per_slice = [{evs[0].comm for evs in part} for part in slices_]
    late = set.union(*comms_per_slice) - comms_per_slice[0]
    assert late, "one communicator is first heard later"
    joined = next(i for i, s in enumerate(comms_per_slice) if s & late)
    # its first slice: it is new to the group, its peers are not; grow and identities
    # happen inside the grouped pass
    alone, _ = _run(slices_[: joined + 4], grouped=False)
    together, _ = _run(slices_[: joined + 4], grouped=True)
    assert together == alone


def test_cuts_match_the_one_by_one_cut(slices: tuple[str, list[list[list[Event]]]]) -> None:
    """The grouped cut's arrays are the single cut's, ops sorted by (rank, seq)."""
    part = max(slices[1], key=len)
    cols = [decode_arrow(encode_arrow(evs))[0] for evs in part]
    for c, g in zip(cols, cut_many(cols), strict=True):
        one = cut_many([c])[0]  # below the group size: the single cut
        assert (g.n, g.top, g.ts_max, g.distinct, g.job) == (one.n, one.top, one.ts_max,
                                                            one.distinct, one.job)  # fmt: skip
        assert g.ident_rank.tolist() == one.ident_rank.tolist()
        assert sorted(zip(g.ro.tolist(), g.seq.tolist(), strict=True)) == list(
            zip(g.ro.tolist(), g.seq.tolist(), strict=True)
        )
        assert sorted(zip(one.ro.tolist(), one.seq.tolist(), strict=True)) == list(
            zip(g.ro.tolist(), g.seq.tolist(), strict=True)
        )
        assert g.rp.tolist() == one.rp.tolist() and g.started.tolist() == one.started.tolist()


def test_communicators_back_from_checkpoints_rejoin_the_layout(
    slices: tuple[str, list[list[list[Event]]]],
) -> None:
    """Halfway, every communicator is replaced by its checkpoint (as a worker restarts
    or a partition moves) while the group lives on: same verdicts and state as alone."""
    slices_ = slices[1]
    cfg = DetectConfig()
    alone, state_alone = _run(slices_, grouped=False)
    group = CommGroup()
    dets: dict[str, CommDetector] = {}
    got: list[bytes] = []
    for i, part in enumerate(slices_):
        if i == len(slices_) // 2:
            dets = {c: CommDetector.from_bytes(d.to_bytes(), cfg) for c, d in dets.items()}
            layouts, rank_layouts = group.stragglers.n_layouts, group.ranks.n_layouts
        items = []
        for evs in part:
            d = dets.setdefault(evs[0].comm, CommDetector(evs[0].comm, cfg))
            items.append((d, decode_arrow(encode_arrow(evs))[0]))
        verdicts = [v for vs in observe_many(items, group) for v in vs]
        now = max(e.ts_us for evs in part for e in evs)
        verdicts += [v for d in dets.values() for v in d.advance(now)]
        got += [encode_verdict(v) for v in verdicts]
    assert group.stragglers.n_layouts > layouts, "the restored aligners were laid out anew"
    assert group.ranks.n_layouts > rank_layouts, "so were the restored rank tables"
    assert got == alone
    assert {c: d.to_bytes() for c, d in dets.items()} == state_alone
