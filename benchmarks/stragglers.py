"""Stragglers / heterogeneous hardware: K = M vs K = 1 vs K = 1 + grace window, side by side.

Two of four learners run 1.2× slower and every learner gets step jitter (chaos `slow_learner` events, the
learner sleeps in its own loop, so it is real wall time). Expected shape (paper): K = 1 + grace has the
goodput of K = 1 and the loss of K = M. Learners here never wait for a round, so every mode's goodput (the
paper's: chip-time not lost to failures) is close to 1; what K = M loses shows in `merged_token_share` (the
fast learners' steps while a round waits for the slow ones are overwritten). Prints a table; the last line
is one JSON object.

    python benchmarks/stragglers.py [--budget 4000000] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

from ddiloco.config.recipes import load_config
from ddiloco.launch import LocalRun
from ddiloco.store.url import open_store

SLOW = (
    "chaos.events=[{kind: slow_learner, learner: 0, factor: 1.0, jitter: 0.1},"
    " {kind: slow_learner, learner: 1, factor: 1.0, jitter: 0.1},"
    " {kind: slow_learner, learner: 2, factor: 1.2, jitter: 0.1},"
    " {kind: slow_learner, learner: 3, factor: 1.2, jitter: 0.1}]"
)
MODES = {
    "K=M": ["diloco.quorum=4", "diloco.grace=null"],
    "K=1": ["diloco.quorum=1", "diloco.grace=null"],
    "K=1+grace": ["diloco.quorum=1"],
}


def run_mode(name: str, overrides: list[str], budget: int, extra: list[str]) -> dict:
    cfg = load_config(
        None, None, ["diloco.learners=4", f"diloco.token_budget={budget}", SLOW, *overrides, *extra]
    )
    cfg.run_id = name.replace("=", "").replace("+", "-").lower()
    with tempfile.TemporaryDirectory() as tmp:
        run = LocalRun(cfg, tmp, metrics_base_port=-1)
        s = run.run(timeout=1800)
        records = [open_store(run.url).get_json(k) for k in open_store(run.url).list("syncer/rounds/")]
    answers = [c for r in records for c in r["contributors"]]
    slow_share = sum(c.split("-")[0] in ("2", "3") for c in answers) / max(1, len(answers))
    rounds_with_slow = sum(
        any(c.split("-")[0] in ("2", "3") for c in r["contributors"]) for r in records
    ) / max(1, len(records))
    acct = s.learner_accounting
    fast_tps = statistics.mean(
        acct[i]["tokens_processed"] / acct[i]["provisioned_seconds"] for i in ("0", "1")
    )
    return {
        "mode": name,
        "goodput": s.goodput,
        "merged_token_share": s.merged_token_share,
        "final_val_loss": s.final_val_loss,
        "wall_seconds": s.wall_seconds,
        "mean_quorum": s.mean_quorum,
        "mean_grace_seconds": s.mean_grace_seconds,
        "fast_learner_tokens_per_s": fast_tps,
        "slow_answers_share": slow_share,
        "rounds_merging_a_slow_learner": rounds_with_slow,
        "tokens_discarded_share": s.tokens_discarded / s.tokens_processed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=int, default=4_000_000)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    rows = [run_mode(m, MODES[m], args.budget, args.overrides) for m in args.modes.split(",")]
    cols = list(rows[0])
    print(" | ".join(f"{c:>14}" for c in cols), file=sys.stderr)
    for r in rows:
        print(
            " | ".join(f"{v:>14.4f}" if isinstance(v, float) else f"{v:>14}" for v in r.values()),
            file=sys.stderr,
        )
    print(json.dumps({"budget": args.budget, "rows": rows}))


if __name__ == "__main__":
    main()
