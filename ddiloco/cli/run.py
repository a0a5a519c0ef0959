"""`ddiloco run`: a whole run on this machine (prepare, syncer + M learner processes, post-training, report).

Design choices:
- Progress goes to stderr (one line rewritten in place on a terminal, a line every 10 s otherwise); stdout
  gets only the location of summary.json, so `ddiloco run` composes with other commands.
- The orchestration lives in `ddiloco.launch.LocalRun`; this module only parses and prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ddiloco import keys
from ddiloco.cli.args import add_config_args, config_from_args
from ddiloco.protocol.summary import Summary
from ddiloco.tracking.progress import Progress, rate_and_eta


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = round(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def _rate(tokens_per_s: float | None) -> str:
    return "?" if tokens_per_s is None else f"{tokens_per_s / 1e3:.1f}k"


def progress_printer(token_budget: int, tty: bool) -> Callable[[Progress], None]:
    """A `LocalRun.run(on_progress=...)` callback printing merged tokens, their rate and the time left, the
    learners' processed tokens per second and MFU (when their peak is known: the syncer's status), live
    learners, rounds and loss."""
    last = [0.0]
    samples: deque[tuple[float, float]] = deque()

    def progress(p: Progress) -> None:
        s = p.status
        merged, budget = (s.tokens_merged, s.token_budget) if s else (0, token_budget)
        rate, eta = rate_and_eta(samples, p.elapsed, merged, budget)
        now = time.monotonic()
        if not tty and now - last[0] < 10:
            return
        last[0] = now
        loss, processed, mfu = (s.loss, s.tokens_per_s, s.mfu) if s else (None, None, None)
        line = (
            f"[{p.elapsed:6.0f}s] merged {merged / 1e6:7.2f}M/{budget / 1e6:.2f}M tokens "
            f"({100 * merged / budget:5.1f}%) {_rate(rate)} tok/s, ETA {_duration(eta)} | processed "
            f"{_rate(processed)} tok/s{'' if mfu is None else f', MFU {100 * mfu:.1f}%'} | live learners "
            f"{s.live_learners if s else 0} | rounds {s.rounds_merged if s else 0} | "
            f"loss {loss if loss is None else f'{loss:.3f}'}"
        )
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    return progress


def _efficiency(summary: Summary) -> str:
    """Processed tokens/s, MFU and peak memory of the fleet, as summary.json has them."""
    mfu, memory = summary.mfu, summary.peak_memory_bytes
    parts = [f"processed {_rate(summary.processed_tokens_per_s)} tok/s"]
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}%")
    if memory is not None:
        parts.append(f"peak memory {memory / 2**30:.2f} GiB ({summary.peak_memory_kind})")
    return ", ".join(parts)


def print_outcome(summary: Summary, report_root: str) -> None:
    """The run's result in three or four lines on stderr."""
    print(
        f"run {summary.run_id}: {summary.status} in {summary.wall_seconds:.0f}s, "
        f"val loss {summary.initial_val_loss:.3f} -> {summary.final_val_loss:.3f}, "
        f"goodput {summary.goodput:.2f}, "
        f"ledger {'balanced' if summary.ledger_balanced else 'UNBALANCED'}",
        file=sys.stderr,
    )
    print(f"learners {_efficiency(summary)}", file=sys.stderr)
    before, after = summary.instruction_accuracy_before, summary.instruction_accuracy_after
    if before and after:
        print(
            f"held-out instruction accuracy {before['all']:.1%} -> {after['all']:.1%} after SFT",
            file=sys.stderr,
        )
    print(f"report: {report_root}/{keys.REPORT_HTML}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from ddiloco.launch import LocalRun  # imports torch: only when a run starts

    cfg = config_from_args(args)
    run = LocalRun(cfg, args.workdir, store_root=args.store, metrics_base_port=args.metrics_port)
    tty = sys.stderr.isatty()
    summary = run.run(on_progress=progress_printer(cfg.diloco.token_budget, tty), timeout=args.timeout)
    if tty:
        print(file=sys.stderr)
    print_outcome(summary, run.summary_location.rsplit("/", 1)[0])
    print(run.summary_location)
    return 0


def register(sub: Any) -> None:
    """Add `run` to the `ddiloco` subcommands."""
    p = sub.add_parser(
        "run", help="prepare, train with a syncer and M learner processes, evaluate, write summary.json"
    )
    add_config_args(p)
    p.add_argument(
        "--workdir", default="runs", help="directory for logs and, by default, the file:// run roots"
    )
    p.add_argument(
        "--store",
        default=None,
        help="store root holding the run prefix instead of --workdir, e.g. s3://bucket/runs",
    )
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="first of M+1 consecutive ports for the syncer's and learners' /metrics "
        "(0: free ports, -1: off)",
    )
    p.set_defaults(func=cmd_run)
