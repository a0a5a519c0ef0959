"""What the end of a finished run did to its model: validation loss just before closing and after it.

The syncer closes a run (`ddiloco.syncer.drain`): every fragment gets one last round on what the learners
trained since its last merge. Those rounds are the only difference between a run's model before closing and
its final model, so comparing the two on the same validation windows measures the closing move alone, free
of the run-to-run spread an asynchronous run has (one 40M-token run moves by ~2% on its own,
docs/results.md §12.9-12.10). `--alphas` also evaluates points along the move, pre + a·(final − pre).

The model before closing is the global model right after the last round merged before closing began: the
round records in merge order, summing each round's tokens over the fragments, up to the done marker's
`tokens_merged − closing_tokens_merged`. It must still be in the store (retention keeps the latest window
of versions: a run evaluated soon after it finished, or kept with `parity.py --keep`).

    DDILOCO_RUN_KEY=$(cat WORKDIR/RUN.key) .venv/bin/python benchmarks/closing_move.py \\
        --store file:///WORKDIR/RUN --alphas 0,0.5,1

Prints one JSON object: `pre_round`, the rounds merged while closing (fragment, steps per answer, step
taken), `val_loss` before and after, `closing_move_pct`, and `loss_by_alpha` when asked.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch

from ddiloco.posttrain.evaluate import load_model, run_validation_loss
from ddiloco.posttrain.summary import read_round_records
from ddiloco.protocol.signing import key_from_env
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store


def rounds_before_closing(records: list[dict], tokens_before: float, fragments: int) -> tuple[int, list]:
    """(the last round merged before closing, the records merged after it), from merge order."""
    ordered = sorted(records, key=lambda r: (r["merged_at"], r["round"]))
    merged, pre, at = 0.0, None, 0
    for i, rec in enumerate(ordered):
        merged += sum(c["c_tokens"] for c in rec["contributors"].values()) / fragments
        if merged > tokens_before + 0.5:
            break
        pre, at = rec["round"], i + 1
    if pre is None:
        raise SystemExit("error: no round merged before closing began; nothing to compare")
    return pre, ordered[at:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="a finished run's root, e.g. file:///dir/run")
    ap.add_argument("--alphas", default="", help="comma list of points along the move (0: before, 1: final)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    root = RunRoot.open(open_store(args.store), key_from_env(), role="closing_move")
    done = root.done()
    if done is None or done.closing is None:
        raise SystemExit(
            "error: this run's done marker says nothing about closing (a run before closing existed)"
        )
    layout, cfg, val = root.layout(), root.config(), root.val()
    pre, after = rounds_before_closing(
        read_round_records(root.store),
        done.tokens_merged - done.closing.closing_tokens_merged,
        layout.num_fragments,
    )

    def loss(model: torch.nn.Module) -> float:
        return run_validation_loss(model, val, cfg)

    before, _ = load_model(root, f"round:{pre}", layout)
    final, _ = load_model(root, "final", layout)
    out = {
        "store": args.store,
        "pre_round": pre,
        "merged_while_closing": [
            {
                "round": r["round"],
                "fragment": r["fragment_id"],
                "steps": [c["c_steps"] for c in r["contributors"].values()],
                "step": r.get("step", "outer"),
            }
            for r in after
        ],
        "closing_tokens_merged": done.closing.closing_tokens_merged,
        "val_loss": {"before": loss(before), "final": loss(final)},
    }
    out["closing_move_pct"] = 100 * (out["val_loss"]["final"] / out["val_loss"]["before"] - 1)
    if args.alphas:
        p0 = {n: t.detach().clone() for n, t in before.named_parameters()}
        p1 = dict(final.named_parameters())
        by_alpha = {}
        for a in (float(x) for x in args.alphas.split(",")):
            with torch.no_grad():
                for n, t in before.named_parameters():
                    t.copy_(p0[n] + a * (p1[n] - p0[n]))
            by_alpha[str(a)] = loss(before)
        out["loss_by_alpha"] = by_alpha
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
