"""Command line of the post-training stages: `ddiloco evaluate`, `ddiloco sft` and `ddiloco report`.

`register(subparsers)` adds them to the main parser (cli.py); each handler prints one JSON object (or the
report paths) on stdout and returns an exit code. Errors a user can fix propagate as ValueError /
StoreError, which cli.main turns into one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

log = logging.getLogger(__name__)


def _tasks(value: str) -> list[str]:
    names = [t.strip() for t in value.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give task names separated by commas, e.g. fact_mc,arithmetic")
    return names


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ddiloco import keys
    from ddiloco.posttrain.evaluate import EvalTasksConfig, evaluate_checkpoint
    from ddiloco.store import open_store

    store = open_store(args.store)
    spec = args.model
    if spec is None:
        spec = "final" if store.exists(keys.FINAL_MODEL) else "latest"
    ecfg = EvalTasksConfig(items_per_task=args.items, tasks=args.tasks, seed=args.seed, device=args.device)
    result = evaluate_checkpoint(store, spec, name=args.name, ecfg=ecfg)
    brief = {k: result[k] for k in ("model", "val_loss", "perplexity", "task_accuracy") if k in result}
    print(json.dumps(brief, sort_keys=True))
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    from ddiloco.posttrain.sft import SFTConfig, run_sft
    from ddiloco.store import open_store

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "base": args.base,
            "data": args.data,
            "steps": args.steps,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "replay_fraction": args.replay_fraction,
            "seed": args.seed,
            "device": args.device,
        }.items()
        if v is not None
    }
    metrics = run_sft(open_store(args.store), SFTConfig(**overrides))
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("loss_curve", "config")}, sort_keys=True))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from ddiloco.posttrain.report import write_comparison, write_reports
    from ddiloco.store import open_store

    stores = [open_store(r) for r in args.runs]
    if len(stores) == 1:
        out = write_reports(stores[0], args.out, curve_points=args.curve_points)
        where = out["paths"] or {k: f"{stores[0].url}/{k}" for k in out["keys"]}
    else:
        if args.out is None:
            raise ValueError("a comparison of several runs needs --out DIR")
        where = write_comparison(stores, args.out, curve_points=args.curve_points)["paths"]
    print(json.dumps(where, sort_keys=True))
    return 0


def register(sub: Any) -> None:
    """Add `evaluate`, `sft` and `report` to the `ddiloco` subcommands."""
    p = sub.add_parser(
        "evaluate",
        help="validation loss, perplexity and downstream task accuracy of a checkpoint in the store",
    )
    p.add_argument("--store", required=True, help="run root, e.g. file:///dir/run or s3://bucket/prefix/run")
    p.add_argument(
        "--model",
        default=None,
        help="final | latest | sft | round:N | learner:ID | a payload key (default: final, else latest)",
    )
    p.add_argument("--name", default=None, help="result name: writes eval/NAME.json (default from --model)")
    p.add_argument("--tasks", type=_tasks, default=None, help="comma-separated task names (default: all)")
    p.add_argument("--items", type=int, default=200, help="items per task (default 200)")
    p.add_argument("--seed", type=int, default=None, help="task seed (default: the run's seed)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser(
        "sft",
        help="fine-tune a checkpoint on prompt/response pairs; writes sft/model.safetensors to the store",
    )
    p.add_argument("--store", required=True, help="run root")
    p.add_argument(
        "--data", default=None, help='JSONL of {"prompt", "response"} (default: built-in instructions)'
    )
    p.add_argument(
        "--base", default=None, help="checkpoint to fine-tune (default final; as evaluate --model)"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 300)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per step (default 32)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    p.add_argument(
        "--replay-fraction",
        type=float,
        default=None,
        help="share of pre-training windows per batch (default 0.5)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="seed of split and batches (default: the run's seed)"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser(
        "report", help="report.html + summary.md for one run, or a comparison page for several"
    )
    p.add_argument("runs", nargs="+", metavar="RUN_ROOT", help="store URL or local run directory")
    p.add_argument(
        "--out",
        default=None,
        help="directory for report.html, summary.md, metrics.json (needed to compare runs)",
    )
    p.add_argument("--curve-points", type=int, default=8, help="points of the post-hoc validation curve")
    p.set_defaults(func=cmd_report)
