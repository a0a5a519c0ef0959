"""Parity benchmark, the numbers derived from finished runs: ratios to data-parallel, the aggregate over seeds,
the issue's checks, and the printed tables. Pure functions of row dicts; nothing here runs anything.

Design choices:
- A row is one run (one configuration, one seed). Every ratio to data-parallel is taken against the
  data-parallel run *of the same seed*, and only then averaged: `loss_vs_dp_pct` of an aggregate row is the
  mean of the per-seed gaps (with their standard deviation, min, max and values by seed);
  `loss_vs_dp_pct_of_means` (the gap between the mean losses) is given next to it.
- The spread is the sample standard deviation (n − 1; null for a single seed) and the min / max.
- `processed_vs_dp` is this row's tokens processed over data-parallel's: 1.00 (within one global batch)
  means the two spent the same compute; ablation rows do not have a data-parallel run of their own, so the
  ratio shows how far from equal compute their `vs DP %` is.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

SPREAD = ("final_val_loss", "loss_vs_dp_pct", "loss_vs_ref_pct", "task_accuracy")
"""Fields aggregated with mean, std, min, max and the value of every seed."""
MEANS = (
    "initial_val_loss",
    "tokens_processed",
    "tokens_merged",
    "processed_vs_dp",
    "wall_seconds",
    "wall_vs_dp",
    "bytes_per_learner",
    "bytes_x_vs_dp",
    "bytes_downloaded_per_learner",
    "total_bytes_x_vs_dp",
    "goodput",
    "mean_answers",
    "steps_per_answer",
    "norm_ratio",
)
"""Fields aggregated by their mean only."""


# --- one run against data-parallel ------------------------------------------------------------------------
def vs_dp(row: dict[str, Any], dp: dict[str, Any] | None) -> None:
    if dp is None:
        return
    row["loss_vs_dp_pct"] = 100 * (row["final_val_loss"] / dp["final_val_loss"] - 1)
    row["processed_vs_dp"] = row["tokens_processed"] / dp["tokens_processed"]
    per_tok = row["bytes_per_learner"] / row["tokens_processed"]
    dp_per_tok = dp["bytes_per_learner"] / dp["tokens_processed"]
    row["bytes_x_vs_dp"] = dp_per_tok / per_tok if per_tok else None
    total_x_vs_dp(row, dp)
    row["wall_vs_dp"] = row["wall_seconds"] / dp["wall_seconds"]
    if row.get("task_accuracy") is not None and dp.get("task_accuracy") is not None:
        row["task_accuracy_vs_dp"] = row["task_accuracy"] - dp["task_accuracy"]


def total_x_vs_dp(row: dict[str, Any], dp: dict[str, Any]) -> None:
    """Up + down bytes per learner per token, data-parallel's over this row's. A ring all-reduce receives as
    many bytes as it sends, so data-parallel's total is twice `bytes_per_learner`; DiLoCo's is its uploads
    plus the global versions (full or download deltas) it downloaded."""
    down = row.get("bytes_downloaded_per_learner")
    if down is None:
        return
    total = (row["bytes_per_learner"] + down) / row["tokens_processed"]
    row["total_bytes_x_vs_dp"] = (2 * dp["bytes_per_learner"] / dp["tokens_processed"]) / total


# --- several seeds ----------------------------------------------------------------------------------------
def spread(values: dict[int, float]) -> dict[str, Any]:
    """Mean, sample standard deviation (None for one value), min, max and the values by seed."""
    xs = list(values.values())
    return {
        "mean": statistics.fmean(xs),
        "std": statistics.stdev(xs) if len(xs) >= 2 else None,
        "min": min(xs),
        "max": max(xs),
        "by_seed": dict(sorted(values.items())),
    }


def aggregate(
    rows: Iterable[dict[str, Any]], key: str = "config", dp: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """One row per configuration (`row[key]`), over its seeds (`row["seed"]`), in order of first appearance.

    SPREAD fields become `<field>` (the mean), `<field>_std`, `_min`, `_max`, `_by_seed`; MEANS fields their
    mean. `loss_vs_dp_pct_of_means` compares the mean loss with data-parallel's mean loss (`dp`: its
    aggregate row, else the rows' own `method == "dp"`) for configurations compared with data-parallel at all
    (they have `loss_vs_dp_pct`). Fields missing from a run are left out of its configuration's numbers."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row[key], []).append(row)
    out = []
    for name, runs in groups.items():
        seeds = [r["seed"] for r in runs]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"{name}: seed listed twice ({seeds}); one run per configuration and seed")
        agg: dict[str, Any] = {key: name, "seeds": sorted(seeds), "n": len(runs)}
        for k in ("method", "label"):
            if k in runs[0]:
                agg.setdefault(k, runs[0][k])
        for field in SPREAD:
            values = {r["seed"]: r[field] for r in runs if r.get(field) is not None}
            if values:
                s = spread(values)
                agg[field] = s.pop("mean")
                agg.update({f"{field}_{k}": v for k, v in s.items()})
        for field in MEANS:
            xs = [r[field] for r in runs if r.get(field) is not None]
            if xs:
                agg[field] = statistics.fmean(xs)
        out.append(agg)
    dp = dp or next((a for a in out if a.get("method") == "dp"), None)
    for a in out:
        if dp is not None and "loss_vs_dp_pct" in a:
            a["loss_vs_dp_pct_of_means"] = 100 * (a["final_val_loss"] / dp["final_val_loss"] - 1)
    return out


def checks(methods: list[dict[str, Any]], ablations: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The issue's targets, evaluated on the aggregate rows (means over seeds; informative: nothing here is
    tuned to pass)."""
    c: dict[str, Any] = {}
    m = {e["method"]: e for e in methods}
    if "decoupled" in m and "dp" in m:
        dec = m["decoupled"]
        c["decoupled_vs_dp_pct"] = {k: dec.get(f"loss_vs_dp_pct{k}") for k in ("", "_std", "_min", "_max")}
        c["decoupled_within_3pct_of_dp"] = dec["loss_vs_dp_pct"] <= 3.0
        c["decoupled_bytes_x_vs_dp"] = dec["bytes_x_vs_dp"]
        c["decoupled_bytes_at_least_100x_lower"] = dec["bytes_x_vs_dp"] >= 100
    a = {k: {r["config"]: r for r in v} for k, v in ablations.items()}
    if "codec" in a and {"codec=fp32", "codec=int4", "codec=int2"} <= set(a["codec"]):
        fp32 = a["codec"]["codec=fp32"]["final_val_loss"]
        c["int4_vs_fp32_pct"] = 100 * (a["codec"]["codec=int4"]["final_val_loss"] / fp32 - 1)
        c["int2_vs_fp32_pct"] = 100 * (a["codec"]["codec=int2"]["final_val_loss"] / fp32 - 1)
        c["int4_loses_under_1pct"] = c["int4_vs_fp32_pct"] < 1.0
    if "merge" in a:
        ms = sorted({int(k.split()[0][2:]) for k in a["merge"]})
        for merge in ("rda", "mean"):
            c[f"{merge}_norm_ratio_by_M"] = {mm: a["merge"][f"M={mm} {merge}"]["norm_ratio"] for mm in ms}
        big = ms[-1]
        c[f"rda_loss_le_mean_at_M{big}"] = (
            a["merge"][f"M={big} rda"]["final_val_loss"] <= a["merge"][f"M={big} mean"]["final_val_loss"]
        )
    if "outer" in a and len(a["outer"]) == 2:
        nesterov, plain = a["outer"].values()
        c["outer_plain_vs_nesterov_pct"] = 100 * (plain["final_val_loss"] / nesterov["final_val_loss"] - 1)
    return c


# --- tables -----------------------------------------------------------------------------------------------
def fmt(v: Any, spec: str = ".4f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float | int) and spec:
        return format(v, spec)
    return str(v)


COLUMNS = [
    ("final_val_loss", "val loss", ".4f"),
    ("loss_vs_dp_pct", "vs DP %", "+.2f"),
    ("loss_vs_ref_pct", "vs ref %", "+.2f"),
    ("task_accuracy", "task acc", ".3f"),
    ("tokens_processed", "tok proc", ",d"),
    ("tokens_merged", "tok merged", ",.0f"),
    ("processed_vs_dp", "proc/DP", ".3f"),
    ("wall_seconds", "wall s", ".0f"),
    ("wall_vs_dp", "wall/DP", ".2f"),
    ("bytes_per_learner", "bytes/learner", ",.0f"),
    ("bytes_x_vs_dp", "DP/this bytes", ".1f"),
    ("bytes_downloaded_per_learner", "down/learner", ",.0f"),
    ("total_bytes_x_vs_dp", "DP/this up+down", ".1f"),
    ("mean_answers", "answers", ".2f"),
    ("steps_per_answer", "steps/answer", ".1f"),
    ("norm_ratio", "|merged|/|Δ|", ".3f"),
]
AGGREGATE_COLUMNS = [
    ("n", "seeds", "d"),
    ("final_val_loss", "val loss", ".4f"),
    ("final_val_loss_std", "± sd", ".4f"),
    ("final_val_loss_min", "min", ".4f"),
    ("final_val_loss_max", "max", ".4f"),
    ("loss_vs_dp_pct", "vs DP %", "+.2f"),
    ("loss_vs_dp_pct_std", "± sd", ".2f"),
    ("loss_vs_dp_pct_min", "min", "+.2f"),
    ("loss_vs_dp_pct_max", "max", "+.2f"),
    ("loss_vs_ref_pct", "vs ref %", "+.2f"),
    ("loss_vs_ref_pct_std", "± sd", ".2f"),
    ("task_accuracy", "task acc", ".3f"),
    ("tokens_processed", "tok proc", ",.0f"),
    ("processed_vs_dp", "proc/DP", ".3f"),
    ("bytes_x_vs_dp", "DP/this bytes", ".1f"),
]


def table(title: str, rows: list[tuple[str, dict[str, Any]]], columns: list | None = None) -> str:
    cols = [c for c in columns or COLUMNS if any(r.get(c[0]) is not None for _, r in rows)]
    head = ["config", *(c[1] for c in cols)]
    body = [[label, *(fmt(r.get(k), f) for k, _, f in cols)] for label, r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([f"## {title}", line(head), line(["-" * w for w in widths]), *map(line, body), ""])
