"""A headline claim from finished `parity.py` runs: docs/results/CLAIM.json, which `render_results.py` reads.

    .venv/bin/python benchmarks/parity_claim.py quality \\
        --run synthetic_40m=q40s.json --run pydocs_40m=q40p.json --run small=small.json

Each `--run NAME=PATH` is one `parity.py --json PATH` result (data-parallel and Decoupled DiLoCo over seeds);
it gives the figures `NAME` (the gap to data-parallel's validation loss, mean ± sd over seeds, as "+0.27% ±
0.18"), `NAME_seeds`, `NAME_up_x` (upload bytes per processed token, data-parallel's over Decoupled
DiLoCo's, mean over seeds), `NAME_updown_x` (up + down, the range over seeds, as "518–522×") and
`NAME_tokens` (tokens processed per run, in millions). The claim's command lines are the runs' own
(`parity.py` writes its argv and commit into its result); the machine is the first run's, its load the range
of the load averages at the runs' starts and ends. The claim file keeps its headline texts (`_record.KEPT`), so the texts may name any of these.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from _record import RESULTS, record

METHOD = "decoupled"


def signed(x: float, digits: int = 2) -> str:
    return f"{x:+.{digits}f}%".replace("-", "\u2212")


def figures_of(name: str, out: dict[str, Any]) -> dict[str, Any]:
    """The figures one parity result gives (module docstring)."""
    agg = next(a for a in out["aggregate"]["methods"] if a["method"] == METHOD)
    rows = [r for r in out["methods"] if r["method"] == METHOD]
    gap, sd = agg["loss_vs_dp_pct"], agg.get("loss_vs_dp_pct_std")
    updown = sorted(r["total_bytes_x_vs_dp"] for r in rows if r.get("total_bytes_x_vs_dp"))
    figs = {
        name: signed(gap) + (f" \u00b1 {sd:.2f}" if sd is not None else ""),
        f"{name}_seeds": len(rows),
        f"{name}_up_x": round(statistics.fmean(r["bytes_x_vs_dp"] for r in rows), 1),
        f"{name}_tokens": f"{statistics.fmean(r['tokens_processed'] for r in rows) / 1e6:.1f}M",
    }
    if updown:
        lo, hi = round(updown[0]), round(updown[-1])
        figs[f"{name}_updown_x"] = f"{lo}\u00d7" if lo == hi else f"{lo}\u2013{hi}\u00d7"
    return figs


def machine_of(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first result's machine; the load: the 1-minute load average at each run's start and end (the
    result's own, taken when it was written, for a result whose rows lack them)."""
    first = outs[0]["machine"]
    rows = [r for o in outs for r in o["methods"]]
    loads = [r[k] for r in rows for k in ("loadavg_start", "loadavg_end") if r.get(k) is not None]
    if not loads:
        loads = [x for o in outs for x in (*o["machine"]["loadavg"], *o["machine"].get("loadavg_end", ()))]
    return {"cpus": first["cpus"], "cpu": first["cpu"], "loadavg": f"{min(loads):.1f}\u2013{max(loads):.1f}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("claim", help="the claim file's name under docs/results (quality, bytes, ...)")
    ap.add_argument(
        "--run", action="append", required=True, metavar="NAME=PATH", help="a parity.py --json result"
    )
    ap.add_argument("--folder", default=str(RESULTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    figures: dict[str, Any] = {}
    runs: dict[str, Any] = {}
    outs, commands, commits = [], [], []
    for item in args.run:
        name, sep, path = item.partition("=")
        if not sep or not name.isidentifier():
            ap.error(f"--run takes NAME=PATH with NAME a Python identifier, got {item!r}")
        out = json.loads(Path(path).read_text())
        if "argv" not in out or "commit" not in out:
            ap.error(f"{path}: no argv/commit in it: a result of parity.py from before it wrote them")
        figures |= figures_of(name, out)
        runs[name] = out["aggregate"]
        outs.append(out)
        commands.append(out["argv"])
        commits.append(out["commit"])
    if len(set(commits)) != 1:
        ap.error(
            f"the runs were made at different commits ({', '.join(sorted(set(commits)))}): one claim, one code"
        )
    path = record(
        args.claim,
        figures,
        {"runs": runs},
        folder=Path(args.folder),
        command=" ; ".join(commands),
        commit=commits[0],
        machine=machine_of(outs),
    )
    sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
