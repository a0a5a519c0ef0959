"""The report's plots: pure functions from run data to PNG bytes.

Design choices:
- `matplotlib.figure.Figure` with the Agg canvas directly, never pyplot: no global backend switch, no
  figure registry to leak, safe in threads and at import.
- Time axes are seconds since the run's first learner started (`RunView.t0`), so runs compare side by side.
- Every plot says so on the canvas when it has no data instead of failing, so a report of a half-finished
  or failed run still renders.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

CHAOS_COLOR = "#d62728"


@dataclass(slots=True)
class RunView:
    """What the plots need from one run, already reduced to plain numbers (see report.load_run)."""

    label: str
    t0: float
    records: list[dict[str, Any]]
    reports: list[dict[str, Any]]
    curve: list[dict[str, Any]]
    num_fragments: int
    events: list[dict[str, Any]] = field(default_factory=list)
    """Chaos events and restarts: {"kind", "t" (seconds since t0), "learner_id"}."""

    def merged_series(self) -> tuple[np.ndarray, np.ndarray]:
        """(seconds since t0, tokens merged so far) at every merge, starting at (0, 0)."""
        recs = sorted(self.records, key=lambda r: r["merged_at"])
        t = [0.0] + [r["merged_at"] - self.t0 for r in recs]
        tok = np.cumsum([0.0] + [sum(c["c_tokens"] for c in r["contributors"].values()) for r in recs])
        return np.asarray(t), tok / max(self.num_fragments, 1)


def _figure(width: float = 5.4, height: float = 3.4) -> Figure:
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="gray")


_AXES = {
    "loss_vs_tokens": ("tokens merged into the global model", "loss (nats/token)", "Loss vs tokens"),
    "loss_vs_time": ("seconds since the first learner started", "validation loss", "Global model over time"),
    "merged_tokens": ("seconds since the first learner started", "tokens merged", "Merged tokens over time"),
    "staleness": (
        "staleness (versions the answer's base was behind)",
        "fraction of answers",
        "Staleness of merged answers",
    ),
    "sft_loss": ("SFT step", "response loss", "Supervised fine-tuning"),
}
"""Plot -> (x label, y label, title)."""


def _finish(
    fig: Figure,
    ax: Any,
    labels: tuple[str, str, str],
    *,
    empty: str | None,
    legend: dict[str, Any] | None = None,
) -> bytes:
    """x label, y label and title (`labels`), grid and (with `legend`, its keyword arguments) a legend;
    `empty`: what was not recorded, said in the middle of the axes. The figure as PNG bytes."""
    if empty is not None:
        _empty(ax, empty)
    x, y, title = labels
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend is not None:
        ax.legend(**legend)
    return _png(fig)


def _mark_events(ax: Any, events: Sequence[dict[str, Any]], *, label: bool = True) -> None:
    seen = False
    for ev in events:
        if ev.get("kind") == "restart":
            ax.axvline(ev["t"], color="#2ca02c", lw=0.8, ls=":", alpha=0.8)
            continue
        ax.axvline(
            ev["t"], color=CHAOS_COLOR, lw=1.0, ls="--", alpha=0.8, label=None if seen else "chaos event"
        )
        if label:
            who = "" if ev.get("learner_id") is None else f" L{ev['learner_id']}"
            ax.annotate(
                f"{ev.get('kind', 'event')}{who}",
                (ev["t"], 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=CHAOS_COLOR,
            )
        seen = True


def loss_vs_tokens(runs: Sequence[RunView], *, learners: bool = True) -> bytes:
    """Global validation loss vs tokens merged; learners' training-loss EMA on the same axis."""
    fig = _figure()
    ax = fig.add_subplot()
    any_data = False
    for i, run in enumerate(runs):
        color = f"C{i}"
        pts = [p for p in run.curve if p.get("val_loss") is not None]
        if pts:
            any_data = True
            ax.plot(
                [p["tokens_merged"] for p in pts],
                [p["val_loss"] for p in pts],
                "o-",
                color=color,
                lw=2,
                label=run.label if len(runs) > 1 else "global model (validation)",
            )
        if learners:
            t, tok = run.merged_series()
            for j, rep in enumerate(sorted(run.reports, key=lambda r: (r["learner_id"], r["incarnation"]))):
                hist = np.asarray(rep.get("history") or [], dtype=float)
                if hist.size == 0:
                    continue
                any_data = True
                x = np.interp(hist[:, 0] - run.t0, t, tok)
                ax.plot(
                    x,
                    hist[:, 3],
                    lw=0.8,
                    alpha=0.6,
                    color=f"C{(j + 1) % 10}" if len(runs) == 1 else color,
                    label=f"learner {rep['learner_id']}.{rep['incarnation']} (train EMA)"
                    if len(runs) == 1
                    else None,
                )
    legend = {"fontsize": 7, "ncol": 2 if learners and len(runs) == 1 else 1, "loc": "upper right"}
    return _finish(
        fig,
        ax,
        _AXES["loss_vs_tokens"],
        empty=None if any_data else "losses",
        legend=legend if any_data else None,
    )


def loss_vs_time(runs: Sequence[RunView]) -> bytes:
    """Global validation loss over wall time, with chaos events."""
    fig = _figure()
    ax = fig.add_subplot()
    any_data = False
    for i, run in enumerate(runs):
        pts = [p for p in run.curve if p.get("val_loss") is not None]
        if pts:
            any_data = True
            ax.plot(
                [p["time"] - run.t0 for p in pts],
                [p["val_loss"] for p in pts],
                "o-",
                color=f"C{i}",
                label=run.label,
            )
        if len(runs) == 1:
            _mark_events(ax, run.events, label=False)
    return _finish(
        fig,
        ax,
        _AXES["loss_vs_time"],
        empty=None if any_data else "validation losses",
        legend={"fontsize": 7, "loc": "upper right"} if any_data else None,
    )


def merged_tokens(runs: Sequence[RunView]) -> bytes:
    """Tokens merged over time, chaos events as dashed lines (single run)."""
    fig = _figure()
    ax = fig.add_subplot()
    for i, run in enumerate(runs):
        t, tok = run.merged_series()
        ax.step(t, tok, where="post", color=f"C{i}", label=run.label)
        if len(runs) == 1:
            _mark_events(ax, run.events)
    return _finish(
        fig,
        ax,
        _AXES["merged_tokens"],
        empty=None if any(r.records for r in runs) else "merges",
        legend={"fontsize": 7},
    )


def incarnations(run: RunView) -> bytes:
    """One row per learner, one bar per incarnation; x where an incarnation ended without a final report."""
    fig = _figure(height=max(2.0, 0.9 + 0.45 * len({r["learner_id"] for r in run.reports})))
    ax = fig.add_subplot()
    ids = sorted({r["learner_id"] for r in run.reports})
    for rep in run.reports:
        y = ids.index(rep["learner_id"])
        start, end = rep["started_at"] - run.t0, rep["time"] - run.t0
        ax.barh(y, end - start, left=start, height=0.6, color=f"C{rep['incarnation'] % 10}", alpha=0.8)
        ax.text(start, y, f" #{rep['incarnation']}", va="center", fontsize=7)
        if not rep.get("final"):
            ax.plot(end, y, "x", color=CHAOS_COLOR, ms=9, mew=2)
    _mark_events(ax, run.events, label=False)
    if not ids:
        _empty(ax, "learners")
    ax.set_yticks(range(len(ids)), [f"learner {i}" for i in ids])
    ax.set_xlabel("seconds since the first learner started  (x = died)")
    ax.set_title("Learner incarnations")
    ax.grid(alpha=0.3, axis="x")
    return _png(fig)


def rounds(runs: Sequence[RunView]) -> bytes:
    """Quorum size per round (top) and grace window / time to quorum (bottom)."""
    fig = _figure(height=4.2)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for i, run in enumerate(runs):
        recs = sorted(run.records, key=lambda r: r["merged_at"])
        t = [r["merged_at"] - run.t0 for r in recs]
        top.plot(t, [r["quorum"] for r in recs], ".", color=f"C{i}", ms=4, label=run.label)
        bottom.plot(
            t, [r["grace_s"] for r in recs], ".", color=f"C{i}", ms=4, label=f"{run.label}: grace window"
        )
        if len(runs) == 1:
            bottom.plot(t, [r["time_to_quorum"] for r in recs], "+", color="C1", ms=4, label="time to quorum")
            _mark_events(top, run.events, label=False)
    if not any(r.records for r in runs):
        _empty(top, "rounds")
    top.set_ylabel("answers merged")
    top.set_title("Rounds: quorum size and waits")
    top.yaxis.get_major_locator().set_params(integer=True)
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("merge time, seconds since the first learner started")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    bottom.legend(fontsize=7)
    if len(runs) > 1:
        top.legend(fontsize=7)
    return _png(fig)


def staleness(runs: Sequence[RunView]) -> bytes:
    """Histogram of contributor staleness (global versions behind at merge)."""
    fig = _figure(height=3.0)
    ax = fig.add_subplot()
    values = [[c["staleness"] for r in run.records for c in r["contributors"].values()] for run in runs]
    top = max((max(v) for v in values if v), default=0)
    bins = np.arange(-0.5, top + 1.5)
    ax.set_xlim(-0.5, max(top, 4) + 0.5)
    for i, (run, v) in enumerate(zip(runs, values, strict=True)):
        if v:
            ax.hist(
                v,
                bins=bins,
                alpha=0.6 if len(runs) > 1 else 0.9,
                color=f"C{i}",
                label=run.label,
                density=True,
            )
    ax.xaxis.get_major_locator().set_params(integer=True)
    return _finish(
        fig, ax, _AXES["staleness"], empty=None if any(values) else "merged answers", legend={"fontsize": 7}
    )


def traffic(runs: Sequence[RunView]) -> bytes:
    """Bytes uploaded and downloaded per learner (summed over incarnations); per run when comparing."""
    fig = _figure(height=3.0)
    ax = fig.add_subplot()
    labels, up, down = [], [], []
    for run in runs:
        per: dict[int, list[float]] = {}
        for rep in run.reports:
            acc = per.setdefault(rep["learner_id"], [0.0, 0.0])
            acc[0] += rep.get("bytes_up", 0)
            acc[1] += rep.get("bytes_down", 0)
        if len(runs) == 1:
            labels += [f"learner {lid}" for lid in sorted(per)]
            up += [per[lid][0] / 1e6 for lid in sorted(per)]
            down += [per[lid][1] / 1e6 for lid in sorted(per)]
        else:
            labels.append(run.label.split(" ", 1)[0])
            up.append(sum(v[0] for v in per.values()) / 1e6)
            down.append(sum(v[1] for v in per.values()) / 1e6)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, up, 0.4, label="uploaded (deltas)")
    ax.bar(x + 0.2, down, 0.4, label="downloaded (globals)")
    ax.set_xticks(x, labels, fontsize=8)
    if not labels:
        _empty(ax, "learner traffic")
    ax.set_ylabel("MB")
    ax.set_title("Traffic per learner" if len(runs) == 1 else "Traffic per run (all learners)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def sft_loss(curve: Sequence[float], steps: int) -> bytes:
    """Response-token loss during SFT (sampled points)."""
    fig = _figure(height=2.8)
    ax = fig.add_subplot()
    if curve:
        ax.plot(np.linspace(0, max(steps - 1, 0), len(curve)), curve, color="C4")
    return _finish(fig, ax, _AXES["sft_loss"], empty=None if curve else "SFT steps")
