"""What the robust merge costs on clean runs: final validation loss of deterministic in-process runs (the
tiny test model, K = M = 3, no grace window: every round merges three answers, so the trimmed mean is a
median-like merge of each round) with the robust options off, `robust_merge: trimmed_mean`, and
`robust_clip: 3`, over seeds. Prints one JSON object: per variant the losses, their mean and spread
(max − min), and the mean's cost relative to off.
Usage: python benchmarks/robust_quality.py --seeds 3 --tokens 40000
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from tests.integration.test_robust_merge import final_loss, run

VARIANTS = {
    "off": (),
    "trimmed_mean": ("diloco.robust_merge=trimmed_mean",),
    "clip3": ("diloco.robust_clip=3",),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40000)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    out: dict = {"tokens": args.tokens, "seeds": args.seeds, "variants": {}}
    for name, overrides in VARIANTS.items():
        losses, t0 = [], time.perf_counter()
        for seed in range(args.seeds):
            r = run(
                f"q-{name}-{seed}-{args.tokens}",
                f"seed={seed}",
                f"diloco.token_budget={args.tokens}",
                *overrides,
            )
            losses.append(final_loss(r))
        out["variants"][name] = {
            "losses": [round(x, 4) for x in losses],
            "mean": round(statistics.mean(losses), 4),
            "spread": round(max(losses) - min(losses), 4),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    off = out["variants"]["off"]["mean"]
    for v in out["variants"].values():
        v["cost_vs_off"] = round(v["mean"] / off - 1, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
