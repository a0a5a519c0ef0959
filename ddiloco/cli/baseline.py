"""`ddiloco baseline`: synchronous data-parallel training on a prepared run root (see `ddiloco.baseline`).

Design choices:
- The baseline trains with the run's own config (model, data, token budget) so the comparison is like for
  like; `--recipe/--config/--set` apply only with `--prepare`, which prepares the run root first.
"""

from __future__ import annotations

import argparse
from typing import Any

from ddiloco.cli.args import add_config_args, config_for_store, emit
from ddiloco.errors import ConfigError
from ddiloco.protocol.signing import key_from_env
from ddiloco.store.url import open_store


def cmd_baseline(args: argparse.Namespace) -> int:
    from ddiloco.baseline import run_baseline  # imports torch: only when it runs
    from ddiloco.run.prepare import prepare

    if args.prepare:
        cfg = config_for_store(args)
        prepare(open_store(args.store), cfg, secret=key_from_env())
    elif args.overrides or args.recipe or args.config:
        raise ConfigError("--recipe/--config/--set only apply with --prepare; the store's config is used")
    summary = run_baseline(
        args.store,
        learners=args.learners,
        tokens=args.tokens,
        device=args.device,
        timeout=args.timeout,
        tasks=not args.no_tasks,
    )
    return emit(
        summary,
        f"baseline {summary['run_id']}: {summary['learners']} ranks, {summary['tokens_processed']} tokens in "
        f"{summary['wall_seconds']:.0f}s, val loss {summary['initial_val_loss']:.3f} -> "
        f"{summary['final_val_loss']:.3f}, {summary['bytes_sent_per_rank'] / 1e6:.1f} MB sent per rank",
    )


def register(sub: Any) -> None:
    """Add `baseline` to the `ddiloco` subcommands."""
    p = sub.add_parser(
        "baseline",
        help="synchronous data-parallel training of the same model, data and token budget (for comparison)",
    )
    p.add_argument(
        "--store", required=True, help="prepared run root, e.g. file:///abs/runs/run-1 (not memory://)"
    )
    p.add_argument("--learners", type=int, default=None, help="M ranks (default diloco.learners)")
    p.add_argument(
        "--tokens", type=int, default=None, help="tokens to process in total (default diloco.token_budget)"
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default=None, help="gloo on CPU, NCCL on CUDA"
    )
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--no-tasks", action="store_true", help="skip the downstream task accuracy")
    p.add_argument(
        "--prepare",
        action="store_true",
        help="prepare the store first from --recipe/--config/--set (a no-op if it is already prepared)",
    )
    add_config_args(p)
    p.set_defaults(func=cmd_baseline)
