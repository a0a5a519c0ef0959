"""`ddiloco simulate goodput|bandwidth`: argument parsing, summary.json loading, tables, JSON and the plot."""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from ddiloco.simulate import bandwidth as bw
from ddiloco.simulate import goodput as gp

logger = logging.getLogger(__name__)

METHOD_LABELS = {"dp": "data-parallel", "elastic_dp": "elastic DP", "decoupled": "decoupled M={m}"}
CODEC_DTYPES = {
    "int2": "int2",
    "int4": "int4",
    "int8": "int8",
    "bf16": "bf16",
    "fp32": "fp32",
    "none": "fp32",
}


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


# --------------------------------------------------------------------------------------------------------
# argument types

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0, "y": gp.YEAR_SECONDS}


def _number(text: str, suffixes: dict[str, float], what: str) -> float:
    t = text.strip().lower().replace("_", "")
    scale = suffixes.get(t[-1:], None) if t and t[-1].isalpha() else None
    try:
        value = float(t[:-1] if scale else t) * (scale or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad {what} {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{what} must be > 0, got {text!r}")
    return value


def count(text: str) -> float:
    """`5e9`, `5B`, `150k`, `1.2M`."""
    return _number(text, _SUFFIX, "count")


def chips(text: str) -> int:
    return round(count(text))


def duration(text: str) -> float:
    """Seconds; `30d`, `12h`, `90m`, `1y` also accepted."""
    return _number(text, _UNITS, "duration")


def distribution(text: str) -> gp.Distribution:
    try:
        return gp.Distribution.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fmt_chips(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:g}M"
    return f"{n / 1e3:g}k" if n >= 1000 else str(n)


# --------------------------------------------------------------------------------------------------------
# goodput


def add_goodput_args(p: argparse.ArgumentParser) -> None:
    d = gp.FailureModel()
    p.add_argument("--chips", type=chips, nargs="+", default=list(gp.PAPER_CHIPS), help="cluster sizes")
    p.add_argument(
        "--learners", type=int, nargs="+", default=None, help="learner counts M (default 2 4 8 16)"
    )
    p.add_argument("--mtbf-years", type=float, default=d.mtbf_years, help="per-chip MTBF, years")
    p.add_argument("--slice-chips", type=int, default=d.slice_chips, help="chips per slice (failure domain)")
    p.add_argument(
        "--repair",
        type=distribution,
        default=d.repair,
        help="time a failed slice is out: const:S, exp:MEAN, lognormal:MEDIAN,SIGMA, uniform:LO,HI",
    )
    p.add_argument(
        "--restart", type=distribution, default=d.restart, help="data-parallel restart after repair"
    )
    p.add_argument("--reconfig", type=distribution, default=d.reconfig, help="elastic reconfiguration pause")
    p.add_argument("--step-seconds", type=float, default=None, help="inner-step time (lost on a failure)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--horizon", type=duration, default=30 * 86400.0, help="simulated time (default 30d)")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="refit repair/restart/reconfig to the paper's DP and elastic-DP rows first",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with a `rows` list")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH", help="write a PNG of goodput vs chips")
    p.add_argument(
        "--from-summary", type=Path, default=None, metavar="PATH", help="a real run's summary.json"
    )


def run_goodput(args: argparse.Namespace) -> int:
    try:
        return _run_goodput(args)
    except (SummaryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_goodput(args: argparse.Namespace) -> int:
    learners, step = args.learners, args.step_seconds
    measured = None
    if args.from_summary is not None:
        s = load_summary(args.from_summary, ("learners", "learner_step_seconds"))
        learners = learners or [int(s["learners"])]
        step = float(s["learner_step_seconds"]) if step is None else step
        measured = {k: s.get(k) for k in ("learners", "learner_step_seconds", "goodput", "wall_seconds")}
    model = gp.FailureModel(
        mtbf_years=args.mtbf_years,
        slice_chips=args.slice_chips,
        repair=args.repair,
        restart=args.restart,
        reconfig=args.reconfig,
        step_seconds=step or 0.0,
    )
    calibration = None
    if args.calibrate:
        frac = [[v / 100 for v in gp.PAPER_GOODPUT[(m, 1)]] for m in ("dp", "elastic_dp")]
        calibration = gp.calibrate(gp.PAPER_CHIPS, *frac, slice_chips=args.slice_chips)
        model = calibration.apply(model)
        logger.info("calibrated to the paper's DP rows: %s", calibration)
    t0 = time.perf_counter()
    rows = gp.simulate_grid(args.chips, learners or [2, 4, 8, 16], model, args.horizon, args.seed)
    wall = time.perf_counter() - t0
    logger.info("simulated %d cells over %.0f days each in %.1f s", len(rows), args.horizon / 86400, wall)
    if args.plot is not None:
        plot_goodput(rows, args.plot)
    if args.json:
        out = {
            "command": "goodput",
            "params": {**model.to_dict(), "horizon_seconds": args.horizon, "seed": args.seed},
            "calibration": None if calibration is None else _calibration_dict(calibration),
            "rows": [r.to_dict() for r in rows],
            "from_summary": measured,
            "wall_seconds": round(wall, 3),
        }
        print(json.dumps(out))
    else:
        print(format_goodput_table(rows, model, args.horizon, calibration, measured))
    return 0


def _calibration_dict(c: gp.Calibration) -> dict[str, float]:
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
        lines.append(f"calibrated on the paper's DP + elastic-DP rows: {_calibration_dict(calibration)}")
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


# --------------------------------------------------------------------------------------------------------
# bandwidth


def add_bandwidth_args(p: argparse.ArgumentParser) -> None:
    n = bw.Network()
    p.add_argument("--params", type=count, default=None, help="model parameters, e.g. 5e9 or 5B (default 5B)")
    p.add_argument("--step-seconds", type=float, default=None, help="inner-step time (default 1)")
    p.add_argument("--sites", type=int, nargs="+", default=None, help="sites / learners (default 2 8)")
    p.add_argument("--utilization", type=float, default=0.9, help="data-parallel target utilization")
    p.add_argument("--fragments", type=int, default=None, help="P (default 24)")
    p.add_argument("--overlap", type=float, default=None, help="τ, inner steps (default 2)")
    p.add_argument(
        "--sync-every", type=int, default=None, help="H, steps per round of a fragment (default 24)"
    )
    p.add_argument("--dtype", nargs="+", choices=bw.DTYPES, default=None, help="decoupled payload dtypes")
    p.add_argument("--dp-dtype", choices=bw.DTYPES, default="bf16", help="data-parallel gradient dtype")
    p.add_argument("--latency-ms", type=float, default=n.latency_ms, help="one-way latency per ring hop")
    p.add_argument("--backward-fraction", type=float, default=n.backward_fraction, help="DP overlap window")
    p.add_argument(
        "--scale-bits",
        type=float,
        default=None,
        help="bits of each int codec's per-128-value scale (default 16; 32 with --from-summary, as our codec)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with a `rows` list")
    p.add_argument(
        "--from-summary", type=Path, default=None, metavar="PATH", help="a real run's summary.json"
    )


_BW_FIELDS = (
    "model_params",
    "learner_step_seconds",
    "num_fragments",
    "sync_every",
    "overlap",
    "codec",
    "fragment_bytes",
    "learners",
)


def run_bandwidth(args: argparse.Namespace) -> int:
    try:
        return _run_bandwidth(args)
    except (SummaryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _pick(flag: Any, summary: dict[str, Any] | None, key: str, default: Any) -> Any:
    if flag is not None:
        return flag
    return summary[key] if summary is not None else default


def _run_bandwidth(args: argparse.Namespace) -> int:
    s = load_summary(args.from_summary, _BW_FIELDS) if args.from_summary is not None else None
    fragment_values = None
    dtypes = args.dtype
    if s is not None:
        codec = str(s["codec"]).lower()
        if codec not in CODEC_DTYPES:
            raise SummaryError(f"{args.from_summary}: unknown codec {s['codec']!r}")
        dtypes = dtypes or [CODEC_DTYPES[codec]]
        fragment_values = tuple(float(b) / 4 for b in s["fragment_bytes"])  # fp32 bytes → values
    work = bw.Workload(
        params=float(_pick(args.params, s, "model_params", bw.PAPER_PARAMS)),
        step_seconds=float(_pick(args.step_seconds, s, "learner_step_seconds", bw.PAPER_STEP_SECONDS)),
        fragments=int(_pick(args.fragments, s, "num_fragments", 24)),
        sync_every=int(_pick(args.sync_every, s, "sync_every", 24)),
        overlap=float(_pick(args.overlap, s, "overlap", 2.0)),
        fragment_values=fragment_values if args.fragments is None else None,
    )
    sites = args.sites or ([int(s["learners"])] if s is not None else [2, 8])
    scale_bits = args.scale_bits if args.scale_bits is not None else (32.0 if s is not None else 16.0)
    net = bw.Network(
        latency_ms=args.latency_ms, backward_fraction=args.backward_fraction, scale_bits=scale_bits
    )
    rows = bw.bandwidth_table(
        work, sites, dtypes or ["bf16", "int4"], utilization=args.utilization, dp_dtype=args.dp_dtype, net=net
    )
    measured = _measured_upload(s, work, net, dtypes or ["fp32"]) if s is not None else None
    params = {
        "params": work.params,
        "step_seconds": work.step_seconds,
        "fragments": work.fragments,
        "sync_every": work.sync_every,
        "overlap": work.overlap,
        "utilization": args.utilization,
        "dp_dtype": args.dp_dtype,
        "latency_ms": net.latency_ms,
        "backward_fraction": round(net.backward_fraction, 4),
        "scale_bits": net.scale_bits,
    }
    if args.json:
        rows_out = [r.to_dict() for r in rows]
        print(
            json.dumps({"command": "bandwidth", "params": params, "rows": rows_out, "from_summary": measured})
        )
    else:
        print(format_bandwidth_table(rows, params, measured))
    return 0


def _measured_upload(
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


# --------------------------------------------------------------------------------------------------------
# wiring


def _add_subcommands(sub: Any) -> None:
    g = sub.add_parser("goodput", help="goodput of DP / elastic DP / Decoupled DiLoCo under chip failures")
    add_goodput_args(g)
    g.set_defaults(func=run_goodput)
    b = sub.add_parser("bandwidth", help="WAN bandwidth for data-parallel vs Decoupled DiLoCo")
    add_bandwidth_args(b)
    b.set_defaults(func=run_bandwidth)


def register(subparsers: Any) -> None:
    """Add `simulate goodput|bandwidth` to the top-level `ddiloco` parser."""
    p = subparsers.add_parser("simulate", help="the paper's large-scale tables, by simulation")
    _add_subcommands(p.add_subparsers(dest="simulate_command", required=True))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddiloco simulate", description=__doc__)
    _add_subcommands(parser.add_subparsers(dest="simulate_command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: `main(["goodput", "--json"])` (a leading "simulate" is accepted too)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
