"""Render the run report: one self-contained HTML page with PNG figures inlined."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: figures go to PNG bytes

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sinks.report.lateness import LatenessMap  # noqa: E402
from streams.commands import IsolationCommand  # noqa: E402

__all__ = ["write_report"]

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


def _timeline(cmds: Sequence[IsolationCommand], truth: dict[str, Any] | None, t0_us: int) -> str:
    hosts = sorted({c.host for c in cmds} | {f["host"] for f in (truth or {}).get("faults", [])})
    fig, ax = plt.subplots(figsize=(10, max(1.8, 0.35 * len(hosts) + 1)))
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
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=False))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set_yticks(range(len(hosts)))
    ax.set_yticklabels(hosts, fontsize=8)
    ax.set_xlabel("seconds since first op")
    ax.set_title("Isolation timeline (○ injected, ✕ decided)", fontsize=10)
    return _png(fig)


def write_report(
    path: str | Path,
    maps: Sequence[LatenessMap],
    commands: Sequence[IsolationCommand],
    *,
    truth: dict[str, Any] | None = None,
    title: str = "c4stream run report",
    max_maps: int = 16,
) -> Path:
    """Write the HTML report; communicators touching an isolated host come first."""
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
                c.gpu if c.gpu is not None else (c.nic or c.peer_host or ""),
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
    timeline = _timeline(commands, truth, t0) if commands or truth else ""
    timeline_img = f'<img alt="timeline" src="data:image/png;base64,{timeline}">' * bool(timeline)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;font-size:13px}}
th{{background:#eee}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1>
<h2>Isolations ({len(commands)})</h2>
<table><tr><th>t (s)</th><th>host</th><th>component</th><th>fault</th><th>action</th>
<th>confidence</th><th>reason</th></tr>{rows}</table>
<h2>Timeline</h2>{timeline_img}
<h2>Per-rank lateness, per communicator</h2>
<p>Lateness = how much later a rank arrived at a collective than the first rank, read from
kernel durations (no clock sync needed). ◀ marks ranks on isolated hosts; dashed lines mark
decisions.</p>{figs}
</body></html>"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
