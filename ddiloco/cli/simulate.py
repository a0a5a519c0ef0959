"""`ddiloco simulate goodput|bandwidth`: the paper's large-scale tables by simulation, from the command line.

The simulations are `ddiloco.simulate.goodput` and `ddiloco.simulate.bandwidth`, their tables and plot
`ddiloco.simulate.tables`; this module parses the flags, runs them and prints a table or one JSON object.

Design choices:
- Sizes and times take suffixes (`1.2M` chips, `5B` parameters, `30d`), as the paper writes them.
- `--from-summary` takes a real run's summary.json: its measured step time, learners and payload sizes
  become the simulation's parameters (flags still win) and its own numbers are printed next to the result.
- A bad summary or parameter is one `error:` line and exit code 2, like every `ddiloco` command.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddiloco.simulate import bandwidth as bw
from ddiloco.simulate import goodput as gp
from ddiloco.simulate import tables

logger = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------------------------------------
# goodput


def _clean_errors(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A bad flag or summary file: one line `error: ...` on stderr and exit code 2, not a traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (tables.SummaryError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run


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


@_clean_errors
def run_goodput(args: argparse.Namespace) -> int:
    learners, step = args.learners, args.step_seconds
    measured = None
    if args.from_summary is not None:
        s = tables.load_summary(args.from_summary, ("learners", "learner_step_seconds"))
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
        tables.plot_goodput(rows, args.plot)
    if args.json:
        out = {
            "command": "goodput",
            "params": {**model.to_dict(), "horizon_seconds": args.horizon, "seed": args.seed},
            "calibration": None if calibration is None else tables.calibration_dict(calibration),
            "rows": [r.to_dict() for r in rows],
            "from_summary": measured,
            "wall_seconds": round(wall, 3),
        }
        print(json.dumps(out))
    else:
        print(tables.format_goodput_table(rows, model, args.horizon, calibration, measured))
    return 0


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
    codec = {"choices": bw.DTYPES, "metavar": "CODEC"}  # the choices are looked up when given or in --help
    p.add_argument("--dtype", nargs="+", default=None, help="decoupled payload codecs: %(choices)s", **codec)
    p.add_argument("--dp-dtype", default="bf16", help="data-parallel gradient codec: %(choices)s", **codec)
    p.add_argument("--latency-ms", type=float, default=n.latency_ms, help="one-way latency per ring hop")
    p.add_argument("--backward-fraction", type=float, default=n.backward_fraction, help="DP overlap window")
    p.add_argument(
        "--scale-bits",
        type=float,
        default=None,
        help="bits of each int codec's per-128-value scale "
        "(default 16; 32 with --from-summary, as our codec)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object with a `rows` list")
    p.add_argument(
        "--from-summary", type=Path, default=None, metavar="PATH", help="a real run's summary.json"
    )


def _pick(flag: Any, summary: dict[str, Any] | None, key: str, default: Any) -> Any:
    if flag is not None:
        return flag
    return summary[key] if summary is not None else default


@_clean_errors
def run_bandwidth(args: argparse.Namespace) -> int:
    s = (
        tables.load_summary(args.from_summary, tables.BANDWIDTH_FIELDS)
        if args.from_summary is not None
        else None
    )
    fragment_values = None
    dtypes = args.dtype
    if s is not None:
        codec = str(s["codec"]).lower()
        if codec not in bw.DTYPES:
            raise tables.SummaryError(f"{args.from_summary}: unknown codec {s['codec']!r}")
        dtypes = dtypes or [codec]
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
    measured = tables.measured_upload(s, work, net, dtypes or ["fp32"]) if s is not None else None
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
        print(tables.format_bandwidth_table(rows, params, measured))
    return 0


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
