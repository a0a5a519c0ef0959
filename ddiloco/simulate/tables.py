"""What the simulations print: the goodput and bandwidth tables, the goodput plot, and a real run's numbers
read from its summary.json to set the simulation's parameters or to compare against.

Design choices:
- Formatting returns strings (the command line prints them); the plot imports matplotlib only when drawn.
- The paper's value sits next to each simulated one (in brackets in the goodput table, a `paper` column for
  bandwidth), so a table shows at a glance where the simulation and the paper differ.
- A summary.json that lacks a field the extrapolation needs is a `SummaryError` naming the field.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from ddiloco.simulate import bandwidth as bw
from ddiloco.simulate import goodput as gp

logger = logging.getLogger(__name__)

METHOD_LABELS = {"dp": "data-parallel", "elastic_dp": "elastic DP", "decoupled": "decoupled M={m}"}


class SummaryError(ValueError):
    """A run summary that cannot be used (missing file, bad JSON, missing or bad field)."""


def load_summary(path: str | Path, fields: tuple[str, ...]) -> dict[str, Any]:
    """Read a run's summary.json and check that every field in `fields` is there."""
    try:
        summary = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SummaryError(f"{path}: no such file") from None
    except json.JSONDecodeError as e:
        raise SummaryError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(summary, dict):
        raise SummaryError(f"{path}: expected a JSON object")
    missing = [f for f in fields if summary.get(f) is None]
    if missing:
        raise SummaryError(f"{path}: missing field(s) {', '.join(missing)} (needed to extrapolate this run)")
    return summary


def _fmt_chips(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:g}M"
    return f"{n / 1e3:g}k" if n >= 1000 else str(n)


def calibration_dict(c: gp.Calibration) -> dict[str, float]:
    return {
        "repair_seconds": c.repair_seconds,
        "restart_seconds": c.restart_seconds,
        "reconfig_seconds": c.reconfig_seconds,
        "rms_points": round(c.rms_points, 3),
    }


def _row_keys(rows: list[gp.GoodputRow]) -> list[tuple[str, int]]:
    return list(dict.fromkeys((r.method, r.learners) for r in rows))


def format_goodput_table(
    rows: list[gp.GoodputRow],
    model: gp.FailureModel,
    horizon: float,
    calibration: gp.Calibration | None = None,
    measured: dict[str, Any] | None = None,
) -> str:
    cols = list(dict.fromkeys(r.chips for r in rows))
    cell = {(r.method, r.learners, r.chips): r for r in rows}
    head = (
        f"MTBF {model.mtbf_years:g} y/chip, slice {model.slice_chips} chips, repair {model.repair.spec()} s, "
        f"restart {model.restart.spec()} s, reconfig {model.reconfig.spec()} s, "
        f"step {model.step_seconds:g} s, {horizon / 86400:g} days simulated per cell"
    )
    lines = [head]
    if calibration is not None:
        lines.append(f"calibrated on the paper's DP + elastic-DP rows: {calibration_dict(calibration)}")
    for title, attr in (("goodput %  (paper's value in brackets)", "goodput"), ("uptime %", "uptime")):
        lines += ["", f"{title:<20}" + "".join(f"{_fmt_chips(c):>13}" for c in cols)]
        for method, m in _row_keys(rows):
            label = METHOD_LABELS[method].format(m=m)
            text = []
            for c in cols:
                r = cell.get((method, m, c))
                v = "" if r is None else f"{100 * getattr(r, attr):.1f}"
                if r is not None and attr == "goodput" and r.paper is not None:
                    v += f" ({100 * r.paper:.0f})"
                text.append(f"{v:>13}")
            lines.append(f"{label:<20}" + "".join(text))
    if measured is not None:
        lines += ["", f"your run (summary.json): {measured}"]
    return "\n".join(lines)


def plot_goodput(rows: list[gp.GoodputRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (method, m) in enumerate(_row_keys(rows)):
        rs = [r for r in rows if (r.method, r.learners) == (method, m)]
        color = f"C{i}"
        label = METHOD_LABELS[method].format(m=m)
        ax.plot([r.chips for r in rs], [100 * r.goodput for r in rs], "o-", color=color, label=label)
        paper = [(r.chips, 100 * r.paper) for r in rs if r.paper is not None]
        if paper:
            ax.plot(*zip(*paper, strict=True), "x--", color=color, alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput %")
    ax.set_title("Goodput under chip failures (o: simulated, x: paper)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)


BANDWIDTH_FIELDS = (
    "model_params",
    "learner_step_seconds",
    "num_fragments",
    "sync_every",
    "overlap",
    "codec",
    "fragment_bytes",
    "learners",
)


def measured_upload(
    s: dict[str, Any], work: bw.Workload, net: bw.Network, dtypes: list[str]
) -> dict[str, Any]:
    """The run's own average upload rate per learner next to what the pacing predicts for it."""
    out: dict[str, Any] = {"learners": s["learners"], "codec": s["codec"]}
    per_value = net.bits_per_value(dtypes[0])
    predicted = work.total_fragment_values * per_value / (work.sync_every * work.step_seconds) / 1e9
    out["predicted_upload_gbps_per_learner"] = float(f"{predicted:.5g}")
    if s.get("bytes_uploaded") is not None and s.get("wall_seconds"):
        rate = 8 * float(s["bytes_uploaded"]) / float(s["wall_seconds"]) / int(s["learners"]) / 1e9
        out["measured_upload_gbps_per_learner"] = float(f"{rate:.5g}")
    return out


def format_bandwidth_table(
    rows: list[bw.BandwidthRow], params: dict[str, Any], measured: dict[str, Any] | None = None
) -> str:
    def g(x: float | None) -> str:
        if x is None:
            return "-"
        return "unreachable" if math.isinf(x) else f"{x:.3g}"

    lines = [
        ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in params.items()),
        "per-site WAN bandwidth, Gbit/s (decoupled: needed = max(deadline, sustained))",
        "",
        f"{'method':<14}{'sites':>6}{'dtype':>7}{'needed':>12}{'deadline':>11}{'sustained':>11}{'paper':>9}",
    ]
    for r in rows:
        paper = "" if r.paper is None else f"{r.paper:g}"
        lines.append(
            f"{r.method:<14}{r.sites:>6}{r.dtype:>7}{g(r.gbps):>12}{g(r.gbps_deadline):>11}"
            f"{g(r.gbps_sustained):>11}{paper:>9}"
        )
    if measured is not None:
        lines += ["", f"your run (summary.json): {measured}"]
    return "\n".join(lines)
