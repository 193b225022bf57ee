"""Render the run report: one self-contained HTML page with PNG figures inlined."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")  # no display: figures go to PNG bytes

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sinks.report.lateness import LatenessMap  # noqa: E402
from streams.commands import IsolationCommand  # noqa: E402
from streams.scoring import component_label  # noqa: E402

__all__ = ["LoopStep", "write_report"]


@dataclass(frozen=True, slots=True)
class LoopStep:
    """What the actuator did after a decision: the isolation, then the job's restart."""

    cmd_id: str
    """The isolation command it belongs to."""
    host: str
    stage: Literal["isolate", "restart"]
    ts_us: int
    """On the run's timeline: the decision's event time plus the actuator's measured delay."""
    status: str
    """done, dry_run, skipped, failed (the actuator's ledger)."""
    detail: str


_STAGE_MARK = {"isolate": "s", "restart": "^"}
_STEP_COLORS = {
    "done": "#2ca02c",
    "dry_run": "#7f7f7f",
    "dry_skipped": "#bcbcbc",
    "skipped": "#ff7f0e",
    "failed": "#d62728",
}
_STAGE_Y = {"isolate": 0.12, "restart": 0.28}  # just above the host's line, in order

_FAULT_COLORS = {
    "noncomm_hang": "#d62728",
    "comm_hang": "#9467bd",
    "straggler": "#ff7f0e",
    "slow_link": "#1f77b4",
    "slow_nic": "#2ca02c",
}


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _heatmap(m: LatenessMap, cmds: Sequence[IsolationCommand]) -> str:
    nranks, nbins = m.lateness_ms.shape
    fig, ax = plt.subplots(figsize=(10, max(2.0, 0.18 * nranks + 1)))
    data = np.ma.masked_invalid(m.lateness_ms)
    vmax = float(np.nanpercentile(m.lateness_ms, 99)) if np.isfinite(data).any() else 1.0
    im = ax.imshow(
        data,
        aspect="auto",
        interpolation="nearest",
        cmap="magma_r",
        vmin=0,
        vmax=max(vmax, 1e-3),
        extent=(0, nbins * m.bin_s, nranks - 0.5, -0.5),
    )
    fig.colorbar(im, ax=ax, label="lateness (ms)")
    isolated = {c.host: c for c in cmds}
    labels = []
    for r, host in enumerate(m.hosts):
        mark = " ◀" if host in isolated else ""
        labels.append(f"{r} {host}{mark}")
    if nranks <= 64:
        ax.set_yticks(range(nranks))
        ax.set_yticklabels(labels, fontsize=7)
        for tick, host in zip(ax.get_yticklabels(), m.hosts, strict=False):
            if host in isolated:
                tick.set_color(_FAULT_COLORS.get(isolated[host].fault, "red"))
                tick.set_fontweight("bold")
    for c in cmds:
        if c.host in m.hosts:
            x = (c.ts_us - m.t0_us) / 1e6
            ax.axvline(x, color=_FAULT_COLORS.get(c.fault, "red"), ls="--", lw=1.2)
    ax.set_xlabel("seconds since first op")
    ax.set_ylabel("rank host")
    ax.set_title(m.comm_name or m.comm, fontsize=10)
    return _png(fig)


def _timeline(
    cmds: Sequence[IsolationCommand],
    truth: dict[str, Any] | None,
    t0_us: int,
    loop: Sequence[LoopStep] = (),
) -> str:
    hosts = sorted({c.host for c in cmds} | {f["host"] for f in (truth or {}).get("faults", [])})
    fig, ax = plt.subplots(figsize=(10, max(1.8, (0.55 if loop else 0.35) * len(hosts) + 1)))
    idx = {h: i for i, h in enumerate(hosts)}
    for f in (truth or {}).get("faults", []):
        ax.scatter(
            (f["start_us"] - t0_us) / 1e6,
            idx[f["host"]],
            facecolors="none",
            edgecolors=_FAULT_COLORS.get(f["expected_fault"], "k"),
            s=120,
            label=f"injected {f['expected_fault']}",
        )
    for c in cmds:
        ax.scatter(
            (c.ts_us - t0_us) / 1e6,
            idx[c.host],
            color=_FAULT_COLORS.get(c.fault, "k"),
            marker="X",
            s=90,
            label=f"decided {c.fault}",
        )
    by_id = {c.id: c for c in cmds}
    for step in loop:
        if step.host not in idx:
            continue
        x = (step.ts_us - t0_us) / 1e6
        y = idx[step.host] + _STAGE_Y[step.stage]
        done = step.status == "done"
        color = _STEP_COLORS.get(step.status, "#d62728")
        ax.scatter(
            x,
            y,
            marker=_STAGE_MARK[step.stage],
            s=60,
            facecolors=color if done else "none",
            edgecolors=color,
            label=f"{step.stage} ({step.status.replace('_', ' ')})",
        )
        cmd = by_id.get(step.cmd_id)
        if cmd is not None:  # tie the step to its decision
            x0 = (cmd.ts_us - t0_us) / 1e6
            ax.plot([x0, x], [idx[step.host], y], color=color, lw=0.8, ls=":")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=False))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_yticks(range(len(hosts)))
    ax.set_yticklabels(hosts, fontsize=8)
    ax.set_xlabel("seconds since first op")
    title = "Isolation timeline (○ injected, ✕ decided"
    title += ", ■ isolation, ▲ job restart; hollow: dry run)" if loop else ")"
    ax.set_title(title, fontsize=10)
    return _png(fig)


def write_report(
    path: str | Path,
    maps: Sequence[LatenessMap],
    commands: Sequence[IsolationCommand],
    *,
    truth: dict[str, Any] | None = None,
    title: str = "c4stream run report",
    max_maps: int = 16,
    loop: Sequence[LoopStep] = (),
) -> Path:
    """Write the HTML report; communicators touching an isolated host come first.

    ``loop``: what the actuator did after each decision (isolation, job restart); shown
    on the timeline and in the "Closing the loop" table.
    """
    path = Path(path)
    isolated_hosts = {c.host for c in commands}
    ranked = sorted(maps, key=lambda m: (not (set(m.hosts) & isolated_hosts), m.comm_name or ""))
    t0 = min((m.t0_us for m in maps), default=min((c.ts_us for c in commands), default=0))
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(x))}</td>"
            for x in (
                f"{(c.ts_us - t0) / 1e6:.1f}",
                c.host,
                component_label(c.gpu, c.nic, c.peer_host, c.fault),  # as the terminal does
                c.fault,
                c.action + (" (dry run)" if c.dry_run else ""),
                f"{c.confidence:.2f}",
                c.reason,
            )
        )
        + "</tr>"
        for c in sorted(commands, key=lambda c: c.ts_us)
    )
    figs = "".join(
        f"<h3>{html.escape(m.comm_name or m.comm)} <small>({m.comm})</small></h3>"
        f'<img alt="lateness heatmap" src="data:image/png;base64,{_heatmap(m, commands)}">'
        for m in ranked[:max_maps]
    )
    timeline = _timeline(commands, truth, t0, loop) if commands or truth else ""
    loop_html = _loop_table(commands, truth, loop, t0) if loop else ""
    timeline_img = f'<img alt="timeline" src="data:image/png;base64,{timeline}">' * bool(timeline)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}
th{{background:#eee}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<h2>Isolations ({len(commands)})</h2>
<table><tr><th>t (s)</th><th>host</th><th>component</th><th>fault</th><th>action</th>
<th>confidence</th><th>reason</th></tr>{rows}</table>
<h2>Timeline</h2>{timeline_img}{loop_html}
<h2>Per-rank lateness, per communicator</h2>
<p>Lateness = how much later a rank arrived at a collective than the first rank, read from
kernel durations (no clock sync needed). ◀ marks ranks on isolated hosts; dashed lines mark
decisions.</p>{figs}
</body></html>"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path


def _loop_table(
    commands: Sequence[IsolationCommand],
    truth: dict[str, Any] | None,
    loop: Sequence[LoopStep],
    t0: int,
) -> str:
    """One row per decision: the fault it answers, the isolation, the restart."""
    steps: dict[tuple[str, str], LoopStep] = {(s.cmd_id, s.stage): s for s in loop}
    faults = (truth or {}).get("faults", [])

    def injected(c: IsolationCommand) -> str:
        ends = [f for f in faults if c.host in (f["host"], f.get("peer_host"))]
        ends = [f for f in ends if f["start_us"] <= c.ts_us]
        if not ends:
            return "-"
        f = max(ends, key=lambda f: f["start_us"])
        return f"{f['expected_fault']} at {(f['start_us'] - t0) / 1e6:.1f}"

    def cell(c: IsolationCommand, stage: str) -> str:
        st = steps.get((c.id, stage))
        if st is None:
            return "-"
        when = (st.ts_us - t0) / 1e6
        return (
            f"<b>{html.escape(st.status.replace('_', ' '))}</b> at {when:.2f}<br>"
            f"<small>{html.escape(st.detail)}</small>"
        )

    rows = "".join(
        f"<tr><td>{html.escape(injected(c))}</td><td>{(c.ts_us - t0) / 1e6:.1f}</td>"
        f"<td>{html.escape(c.host)}</td>"
        f"<td>{html.escape(component_label(c.gpu, c.nic, c.peer_host, c.fault))}</td>"
        f"<td>{html.escape(c.fault)}</td>"
        f"<td>{cell(c, 'isolate')}</td><td>{cell(c, 'restart')}</td></tr>"
        for c in sorted(commands, key=lambda c: c.ts_us)
    )
    return (
        "<h2>Closing the loop</h2><p>Fault injected → decision → isolation → job restart "
        "(times in seconds on the timeline above; the actuator's steps are placed at the "
        "decision's time plus the actuator's own measured delay).</p>"
        "<table><tr><th>injected (s)</th><th>decided (s)</th><th>host</th><th>component</th>"
        "<th>fault</th>"
        f"<th>isolation</th><th>job restart</th></tr>{rows}</table>"
    )
