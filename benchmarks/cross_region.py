"""Cross-region: Decoupled DiLoCo and data-parallel behind slow links, at equal tokens (tiny recipe, CPU).

For every link (default: none, 100 Mbit/s and 10 Mbit/s, each limited one with 50 ms one-way latency):

- `diloco`: `ddiloco run`'s local orchestrator (LocalRun: a syncer and M learner processes over file://) with
  the run's `link` section set, so every learner reaches the store through its own shaped link
  (`ddiloco.store.shaped`: token buckets per direction, a round trip per request). The syncer sits next to
  the store (unshaped). Token budget = merged tokens.
- `dp`: `ddiloco.baseline` (M gloo ranks, an all-reduce of every gradient every step) on a store prepared
  with the same config, for the same number of tokens as the DiLoCo budget. When the baseline applies the
  config's `link` to its all-reduce (a sleep of `Link.allreduce_seconds` per bucket, its summary then
  carries `link_seconds_per_rank`), the slowdown is measured; otherwise this script adds the same
  ring-all-reduce time to the measured unlimited step time and marks the row `estimated`.

Per row: tokens/s per learner (DiLoCo: each learner's tokens processed / seconds from joining to exit,
averaged; dp: tokens / wall / M), its ratio to the same method without a limit, final validation loss (its
change vs no limit), wall seconds, tokens processed and merged, MB uploaded per learner, late answers.

    .venv/bin/python benchmarks/cross_region.py [--learners 4] [--tokens 300000] [--links none,100Mbit,10Mbit]
        [--latency 50ms] [--set key=value ...] [--no-dp] [--json PATH]

Prints a table; the last line is one JSON object (also written to --json PATH): `rows`, `checks` (the
issue's targets on what was measured), `machine`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco.baseline import run_baseline
from ddiloco.config.recipes import load_config
from ddiloco.config.run import RunConfig
from ddiloco.launch import LocalRun
from ddiloco.posttrain.summary import read_reports
from ddiloco.run.prepare import prepare
from ddiloco.store.shaped import Link
from ddiloco.store.url import open_store

log = logging.getLogger("cross_region")

COMMON = ("sft=null", "eval.items_per_task=8", "eval.curve_points=2")


def config(args: argparse.Namespace, link: str | None) -> RunConfig:
    sets = [*COMMON, f"diloco.learners={args.learners}", f"diloco.token_budget={args.tokens}", *args.set]
    if link is not None:
        sets += [f"link.bandwidth={link}", f"link.latency={args.latency}"]
    return load_config(args.recipe, None, sets)


def step_fraction(reports: list[dict[str, Any]]) -> float:
    """Share of the learners' time (joining to exit) spent inside inner steps: what a blocking link lowers."""
    up = sum(r["time"] - r["joined_at"] for r in reports if r.get("joined_at"))
    return sum(r["busy_seconds"] for r in reports if r.get("joined_at")) / up if up > 0 else 0.0


def learner_tokens_per_second(reports: list[dict[str, Any]]) -> float:
    """Mean over learner incarnations of tokens processed / seconds from joining to the last report."""
    rates = [
        r["tokens_processed"] / (r["time"] - r["joined_at"])
        for r in reports
        if r.get("joined_at") and r["time"] > r["joined_at"] and r["tokens_processed"] > 0
    ]
    return statistics.fmean(rates) if rates else 0.0


def run_diloco(
    args: argparse.Namespace, link: str | None, workdir: Path, budget: int | None = None
) -> dict[str, Any]:
    cfg = config(args, link)
    cfg.run_id = "xr"
    cfg.diloco.token_budget = budget or cfg.diloco.token_budget
    run = LocalRun(cfg, workdir, metrics_base_port=-1)
    s = run.run(timeout=args.timeout)
    M, reports = cfg.diloco.learners, read_reports(run.store)
    return {
        "method": "diloco",
        "link": link or "none",
        "latency": args.latency if link else None,
        "token_budget": cfg.diloco.token_budget,
        "equal": "processed" if budget else "merged",
        "tokens_per_second_per_learner": learner_tokens_per_second(reports),
        "step_fraction": step_fraction(reports),
        "final_val_loss": s.final_val_loss,
        "initial_val_loss": s.initial_val_loss,
        "wall_seconds": s.wall_seconds,
        "tokens_processed": s.tokens_processed,
        "tokens_merged": s.tokens_merged,
        "mb_up_per_learner": s.bytes_uploaded / M / 1e6,
        "mb_down_per_learner": s.bytes_downloaded / M / 1e6,
        "late_answers": s.late_answers,
        "mean_quorum": s.mean_quorum,
        "rounds": s.rounds,
        "goodput": s.goodput,
        "merged_token_share": s.merged_token_share,
        "ledger_balanced": s.ledger_balanced,
        "mode": "measured",
    }


def run_dp(
    args: argparse.Namespace, link: str | None, workdir: Path, unlimited: dict | None
) -> dict[str, Any]:
    cfg = config(args, link)
    cfg.run_id = "xr-dp"
    url = f"file://{workdir.resolve()}/{cfg.run_id}"
    prepare(open_store(url), cfg)
    s = run_baseline(url, learners=cfg.diloco.learners, tokens=args.tokens, timeout=args.timeout, tasks=False)
    M, wall, mode = s["learners"], s["wall_seconds"], "measured"
    parsed = Link.from_config(cfg.link)
    link_s = s.get("link_seconds_per_rank")
    if parsed is not None and link_s is None:
        # The baseline ignored the link: measured compute + the ring all-reduce time of every bucket.
        calls = s["allreduce_calls_per_rank"]
        link_s = calls * parsed.allreduce_seconds(int(s["bytes_allreduced_per_rank"] / max(1, calls)), M)
        wall, mode = (unlimited["wall_seconds"] if unlimited else wall) + link_s, "estimated"
    # One rank per machine: the unlimited run's step time (compute + loopback) plus the link's time. On a
    # machine with fewer cores than ranks a sleeping rank lends its core to the others, hiding part of it.
    projected = (unlimited["wall_seconds"] if unlimited else wall) + (link_s or 0.0)
    return {
        "method": "dp",
        "link": link or "none",
        "latency": args.latency if link else None,
        "equal": "processed",
        "tokens_per_second_per_learner": s["tokens_processed"] / wall / M,
        "projected_wall_seconds": projected,
        "projected_tokens_per_second_per_learner": s["tokens_processed"] / projected / M,
        "final_val_loss": s["final_val_loss"],
        "initial_val_loss": s["initial_val_loss"],
        "wall_seconds": wall,
        "tokens_processed": s["tokens_processed"],
        "tokens_merged": s["tokens_processed"],
        "mb_up_per_learner": s["bytes_sent_per_rank"] / 1e6,
        "steps": s["steps"],
        "link_seconds_per_rank": link_s,
        "mode": mode,
    }


def medians(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, link, equal): the median of every number over its repeats."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["link"], r["equal"]), []).append(r)
    rows = []
    for group in groups.values():
        row = dict(group[0])
        for k, v in group[0].items():
            if (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and all(g.get(k) is not None for g in group)
            ):
                row[k] = statistics.median(g[k] for g in group)
        row["repeats"] = len(group)
        rows.append(row)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        ref = next(x for x in rows if x["method"] == r["method"] and x["link"] == "none")
        r["speed_vs_unlimited"] = r["tokens_per_second_per_learner"] / ref["tokens_per_second_per_learner"]
        r["loss_change_vs_unlimited"] = r["final_val_loss"] / ref["final_val_loss"] - 1
        if "projected_wall_seconds" in r:
            r["projected_slowdown"] = r["projected_wall_seconds"] / ref["wall_seconds"]


def checks(rows: list[dict[str, Any]], slowest: str, latency: str) -> dict[str, Any]:
    def row(method: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["method"] == method and r["link"] == slowest), None)

    out: dict[str, Any] = {"link": f"{slowest}, {latency}"}
    d, p = row("diloco"), row("dp")
    if d is not None:
        out["diloco_speed_vs_unlimited"] = d["speed_vs_unlimited"]
        out["diloco_step_fraction"] = d["step_fraction"]
        out["diloco_keeps_90pct_tokens_per_s"] = d["speed_vs_unlimited"] >= 0.9
        out["diloco_loss_change_equal_merged"] = d["loss_change_vs_unlimited"]
        out["diloco_loss_within_2pct_equal_merged"] = abs(d["loss_change_vs_unlimited"]) <= 0.02
        eq = next((r for r in rows if r["method"] == "diloco" and r["equal"] == "processed"), None)
        if eq is not None:
            out["diloco_loss_change_equal_processed"] = d["final_val_loss"] / eq["final_val_loss"] - 1
            out["diloco_loss_within_2pct_equal_processed"] = (
                abs(out["diloco_loss_change_equal_processed"]) <= 0.02
            )
    if p is not None:
        out["dp_slowdown"] = 1 / p["speed_vs_unlimited"]
        out["dp_slowed_10x"] = out["dp_slowdown"] >= 10
        out["dp_slowdown_measured"] = p["mode"] == "measured"
        out["dp_slowdown_projected_one_rank_per_machine"] = p["projected_slowdown"]
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = f"{'method':8} {'link':>8} {'equal':>9} {'tok/s/learner':>13} {'vs none':>8} {'in steps':>8} {'val loss':>9} {'Δloss':>7} {'wall s':>7} {'processed':>10} {'merged':>9} {'MB up/l':>8} mode"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['method']:8} {r['link']:>8} {r['equal']:>9} {r['tokens_per_second_per_learner']:13.0f} {r['speed_vs_unlimited']:8.2f} "
            f"{'' if r.get('step_fraction') is None else format(r['step_fraction'], '.0%'):>8} "
            f"{r['final_val_loss']:9.4f} {100 * r['loss_change_vs_unlimited']:+6.1f}% {r['wall_seconds']:7.1f} "
            f"{r['tokens_processed']:10.0f} {r['tokens_merged']:9.0f} {r['mb_up_per_learner']:8.2f} {r['mode']}"
            + (
                f" (one rank per machine: {r['projected_slowdown']:.1f}x slower)"
                if r.get("link_seconds_per_rank")
                else ""
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="tiny-cpu")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=300_000, help="DiLoCo merged-token budget = dp tokens")
    ap.add_argument(
        "--links", default="none,100Mbit,10Mbit", help="comma-separated bandwidths; none = unlimited"
    )
    ap.add_argument("--latency", default="50ms", help="one-way latency of every limited link")
    ap.add_argument("--set", action="append", default=[], help="config override for every run (repeatable)")
    ap.add_argument("--no-dp", action="store_true", help="skip data-parallel")
    ap.add_argument(
        "--no-equal-processed",
        action="store_true",
        help="skip the extra unlimited DiLoCo run whose budget matches the slowest link's tokens processed",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="runs per configuration (interleaved); rows = medians"
    )
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", help="also write the JSON result here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    links = [None if x.strip() in ("none", "") else x.strip() for x in args.links.split(",")]
    if links[0] is not None:
        links.insert(0, None)  # ratios are against the unlimited run
    load0 = os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="xr-") as tmp:
        for rep in range(args.repeat):  # interleaved, so a busy spell of a shared machine hits every link
            first = len(runs)
            for i, link in enumerate(links):
                log.info("diloco, link %s (repeat %d)", link or "unlimited", rep)
                runs.append({**run_diloco(args, link, Path(tmp) / f"diloco-{rep}-{i}"), "repeat": rep})
            if not args.no_equal_processed and len(links) > 1:
                # Slower links process more tokens per merged token (longer rounds, more late answers):
                # compare the slowest link with an unlimited run that processes about as many tokens, too.
                ref, slow = runs[first], runs[-1]
                budget = int(slow["tokens_processed"] * ref["tokens_merged"] / ref["tokens_processed"])
                log.info("diloco, link unlimited, budget %d (equal tokens processed)", budget)
                runs.append({**run_diloco(args, None, Path(tmp) / f"diloco-eq-{rep}", budget), "repeat": rep})
            unlimited = None
            for i, link in enumerate([] if args.no_dp else links):
                log.info("data-parallel, link %s (repeat %d)", link or "unlimited", rep)
                runs.append({**run_dp(args, link, Path(tmp) / f"dp-{rep}-{i}", unlimited), "repeat": rep})
                unlimited = unlimited or runs[-1]
    rows = medians(runs)
    add_ratios(rows)
    result = {
        "rows": rows,
        "runs": runs,
        "checks": checks(rows, links[-1] or "none", args.latency),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg()[0],
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "settings": {
            "recipe": args.recipe,
            "learners": args.learners,
            "tokens": args.tokens,
            "latency": args.latency,
            "set": args.set,
        },
    }
    print(table(rows), file=sys.stderr)
    print(json.dumps(result["checks"]), file=sys.stderr)
    text = json.dumps(result, sort_keys=True)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
