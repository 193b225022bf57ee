"""The reason a command gives a person on call: what was seen, on which component,
over which windows and communicators (the host correlator's words, written once)."""

from __future__ import annotations

from typing import Any

from streams.core.episode import Entry
from streams.core.findings import CommHangEvidence, HangEvidence, SlowEvidence, StragglerEvidence

__all__ = ["command_evidence", "median_of", "plural", "reason_text"]


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def median_of(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def reason_text(
    fault: str,
    host: str,
    comp: tuple,
    es: list[Entry],
    w0: int,
    w1: int,
    silent_gpus: set[int] | None = None,
) -> str:
    """One sentence a person on call can act on."""
    gpu, nic, peer = comp
    n_comms = len({e.comm for e in es})
    on = plural(n_comms, "communicator")
    span = f"{max(1.0, (w1 - w0) / 1e6):.0f} s"
    if fault == "straggler":
        st = [e.ev for e in es if isinstance(e.ev, StragglerEvidence)]
        n = sum(x.collectives for x in st)
        last = sum(x.last_frac * x.collectives for x in st) / max(n, 1)
        vs = [x.peer_time_vs_normal for x in st if x.peer_time_vs_normal]
        px = median_of([x.peer_time_x for x in st])
        wait = (
            f"its peers waited {median_of(vs):.1f}x their normal time"
            if vs
            else f"its peers spent {px:.1f}x its kernel time"
        )
        if st and all(x.arrival == "enqueue_time" for x in st):  # snapshots without timing
            late = median_of([x.late_ms for x in st])
            wait = f"its peers waited {late:.1f} ms for it per collective (by enqueue times)"
        if gpu is None:  # several GPUs alike: the host
            gpus = sorted({e.comp[0] for e in es if e.comp[0] is not None})
            if gpus:
                return (
                    f"{host} is a straggler: its GPUs {', '.join(map(str, gpus))} arrived "
                    f"last in {last:.0%} of {n} collectives on {on} over {span}, {wait}; no "
                    "communicator inside the host names one GPU."
                )
        who = f"{host} GPU {gpu}" if gpu is not None else host
        # a GPU slow on every step is last in nearly every collective it is in; last in
        # a minority of them (whichever rule fired: windows with a run of slow steps
        # meet the per-window rule) while its wait still meets the bar, it is slow on a
        # minority of steps
        if st and (all(x.intermittent for x in st) or last < 0.5):
            late = median_of([x.late_ms for x in st])
            share = median_of([x.step_share or 0.0 for x in st])
            return (
                f"{who} is intermittently late: it arrived last in {last:.0%} of {n} "
                f"collectives on {on} over {span} (on a minority of steps), its peers then "
                f"waiting {late:.1f} ms for it, {share:.0%} of the step or more overall; a "
                "GPU that slows down now and then (check its clocks, temperature and power)."
            )
        return (
            f"{who} is a straggler: it arrived last in {last:.0%} of {n} "
            f"collectives on {on} over {span}, {wait}."
        )
    if fault == "noncomm_hang":
        hs = [e.ev for e in es if isinstance(e.ev, HangEvidence)]
        tgt = sorted({x.target_collective for x in hs if x.target_collective >= 0})
        wait = max((x.wait_s for x in hs), default=0.0)
        coll = f"collective {tgt[0]}" if len(tgt) == 1 else "the current collective"
        gpus = sorted({e.comp[0] for e in es if e.comp[0] is not None} | (silent_gpus or set()))
        absent = next((x.absent for x in hs if x.absent), "")
        if absent:  # a snapshot member with nothing to say while its peers wait for it
            what = ("left no dump: its process died or never reached the dump"
                    if absent == "no dump" else "wrote an empty dump: it is wedged")  # fmt: skip
            return (
                f"{host} {what}; {max(x.peers_waiting for x in hs)} ranks waited "
                f"{wait:.1f} s for it on {on}."
            )
        if gpu is None and len(gpus) >= 2:  # the host as a whole
            silent = all(x.silent for x in hs) or bool(silent_gpus)
            gone = "went silent" if silent else "stopped as a whole"
            return (
                f"{host} {gone}: {plural(len(gpus), 'GPU')} "
                f"({', '.join(map(str, gpus))}) stopped while their peers waited {wait:.1f} s "
                f"in {coll} on {on}; the host, not one GPU, is at fault."
            )
        if gpu is None and any(x.silent for x in hs):
            return (
                f"{host} went silent: {plural(len(gpus), 'GPU')} stopped reporting on "
                f"{on} while their peers waited {wait:.1f} s in {coll}."
            )
        who = f"{host} GPU {gpu}" if gpu is not None else host
        if all(x.silent for x in hs):
            return f"{who} went silent on {on} while its peers waited {wait:.1f} s in {coll}."
        return (
            f"{who} hangs: it has not started {coll} on {on} while its peers waited {wait:.1f} s."
        )
    if fault == "comm_hang":
        cs = [e.ev for e in es if isinstance(e.ev, CommHangEvidence)]
        wait = max((x.wait_s for x in cs), default=0.0)
        why = cs[-1].why if cs else "no progress"
        what = f"link {host} {nic} -> {peer}" if peer else f"{host} {nic}"
        return (
            f"{what} is dead: a collective on {on} hung for {wait:.1f} s on all ranks "
            f"({why} on the connections it carries)."
        )
    ratio = median_of([e.ev.throughput_ratio for e in es if isinstance(e.ev, SlowEvidence)])
    windows = len({e.window for e in es})
    fams = sorted({e.ev.family for e in es if isinstance(e.ev, SlowEvidence) and e.ev.family})
    against = f" (against the same connection of the other {' and '.join(fams)})" if fams else ""
    if fault == "slow_nic":
        return (
            f"{host} {nic} is slow: its connections moved {ratio:.0%} of their peers' "
            f"median throughput in {plural(windows, 'window')} over {span} on {on}{against}."
        )
    return (
        f"link {host} {nic} -> {peer} is slow: it moved {ratio:.0%} of the median "
        f"throughput in {plural(windows, 'window')} over {span} on {on}{against}."
    )


# ---------------------------------------------------------------------- checkpoints


def command_evidence(
    chosen: list[Entry], total: float, at: int, windows: set[int], comms: set[str]
) -> dict[str, Any]:
    """A command's ``evidence``: the communicators and windows its decision used, of
    all the episode had, and when the evidence became enough."""
    w0 = min(e.window for e in chosen)
    return {
        "communicators": sorted({e.ev.comm_name or e.comm for e in chosen}),
        "comm_ids": sorted({e.comm for e in chosen}),
        "windows": len({e.window for e in chosen}),
        "verdicts": len(chosen),
        "score": round(total, 3),
        "first_window_us": w0,
        "decided_after_s": round((at - w0) / 1e6, 1),
        "all_communicators": len(comms),
        "all_windows": len(windows),
    }
