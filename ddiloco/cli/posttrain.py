"""Command line of the post-training stages: `ddiloco evaluate`, `ddiloco sft`, `ddiloco report` and
`ddiloco export`.

Each handler prints one JSON object (or the report paths) on stdout and returns an exit code. Errors a user
can fix propagate as ValueError / StoreError, which `ddiloco.cli.main` turns into one line on stderr and exit
code 2.

Design choices:
- `evaluate` and `sft` run with the `eval:` and `sft:` sections of the config the run was prepared with (the
  run root's config.json), the same settings `ddiloco run` post-trains with; `--set eval.KEY=VALUE` /
  `--set sft.KEY=VALUE` change them for this invocation, and a flag given explicitly (`--items`, `--steps`,
  ...) wins over both.
- An `sft: null` run (no fine-tuning planned) can still be fine-tuned by hand: the section's defaults apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any, TypeVar

from ddiloco.cli.args import add_set_arg, emit, with_section_overrides
from ddiloco.config.run import EvalConfig, SFTConfig
from ddiloco.store.url import open_store

log = logging.getLogger(__name__)
Section = TypeVar("Section", EvalConfig, SFTConfig)


def _tasks(value: str) -> list[str] | Path:
    if Path(value).expanduser().is_dir():  # a directory of lm-eval task YAMLs
        return Path(value).expanduser()
    names = [t.strip() for t in value.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give task names separated by commas, e.g. fact_mc,arithmetic")
    return names


def with_flags(section: Section, **flags: Any) -> Section:
    """A copy of the config section with the flags that were given (not None) set, validated."""
    out = dataclasses.replace(section, **{k: v for k, v in flags.items() if v is not None})
    out.validate()
    return out


def cmd_evaluate(args: argparse.Namespace) -> int:
    from ddiloco.posttrain.evaluate import evaluate_checkpoint  # imports torch: only when it runs
    from ddiloco.posttrain.tracked import posttrain_tracker
    from ddiloco.run.root import RunRoot

    root = RunRoot.from_env(open_store(args.store), role="evaluate")
    cfg = with_section_overrides(root.config(), "eval", args.overrides)
    task_dir = args.tasks if isinstance(args.tasks, Path) else None
    if task_dir is not None and args.harness != "lm-eval":
        raise ValueError(f"--tasks {task_dir} is a directory of lm-eval task YAMLs: add --harness lm-eval")
    names = None if task_dir is not None else args.tasks
    ecfg = with_flags(cfg.eval, items_per_task=args.items, tasks=names, seed=args.seed, device=args.device)
    spec = args.model
    if spec is None:
        spec = "final" if root.has_final_model() else "latest"
    if spec == "sft" and (why := root.sft_skipped()) is not None:
        return emit({"model": spec, "skipped": why})
    if args.harness == "lm-eval":
        return _evaluate_lm_eval(root, cfg, ecfg, spec, args.name, task_dir)
    with posttrain_tracker(args.store, cfg) as tracker:
        result = evaluate_checkpoint(root, spec, name=args.name, ecfg=ecfg, tracker=tracker)
    brief = {k: result[k] for k in ("model", "val_loss", "perplexity", "task_accuracy") if k in result}
    return emit(brief)


def _evaluate_lm_eval(
    root: Any, cfg: Any, ecfg: EvalConfig, spec: str, name: str | None, task_dir: Any
) -> int:
    from ddiloco.platform.devices import resolve_device
    from ddiloco.posttrain.evaluate import build_tasks
    from ddiloco.posttrain.lmeval import metrics_of, run_lm_eval

    name = name or spec.replace(":", "-").replace("/", "_")
    device = str(resolve_device(ecfg.device))
    if task_dir is None:
        tasks = build_tasks(root, cfg, root.tokenizer(), root.val(), ecfg)
        result = run_lm_eval(root, spec, name=name, tasks=tasks, device=device)
    else:
        result = run_lm_eval(root, spec, name=name, task_dir=task_dir, device=device)
    return emit({"model": spec, "harness": "lm-eval", "lm_eval": metrics_of(result)})


def cmd_sft(args: argparse.Namespace) -> int:
    from ddiloco.posttrain.sft import run_sft, skip_without_instructions  # imports torch: only when it runs
    from ddiloco.posttrain.tracked import posttrain_tracker, track_sft
    from ddiloco.run.root import RunRoot

    root = RunRoot.from_env(open_store(args.store), role="sft")
    cfg = with_section_overrides(root.config(), "sft", args.overrides)
    scfg = with_flags(cfg.sft or SFTConfig(), **{name: getattr(args, name) for name in SFT_FLAGS})
    if args.skip_without_data and (why := skip_without_instructions(root, scfg)) is not None:
        return emit({"skipped": why})
    with posttrain_tracker(args.store, cfg) as tracker:
        metrics = run_sft(root, scfg)
        track_sft(tracker, metrics)
    return emit({k: v for k, v in metrics.items() if k not in ("loss_curve", "config")})


def cmd_report(args: argparse.Namespace) -> int:
    from ddiloco.posttrain.report import write_comparison, write_reports

    stores = [open_store(r) for r in args.runs]
    if len(stores) == 1:
        track_report_curve(args.runs[0], stores[0], args.curve_points)
        out = write_reports(stores[0], args.out, curve_points=args.curve_points)
        where = out["paths"] or {k: f"{stores[0].url}/{k}" for k in out["keys"]}
    else:
        if args.out is None:
            raise ValueError("a comparison of several runs needs --out DIR")
        where = write_comparison(stores, args.out, curve_points=args.curve_points)["paths"]
    return emit(where)


def track_report_curve(url: str, store: Any, points: int) -> None:
    """The loss curve the report draws, computed first so that a fresh one is logged (`ddiloco.tracking`);
    the report then reads it from its cache."""
    from ddiloco.keys import LAYOUT
    from ddiloco.posttrain.evaluate import global_loss_curve
    from ddiloco.posttrain.tracked import posttrain_tracker
    from ddiloco.run.root import RunRoot

    if not store.exists(LAYOUT):  # not a prepared run: the report says so
        return
    root = RunRoot.from_env(store, role="report")
    with posttrain_tracker(url, root.config()) as tracker:
        global_loss_curve(root, points, tracker=tracker)


def cmd_export(args: argparse.Namespace) -> int:
    from ddiloco.posttrain.export import export_model  # imports transformers: only when it runs
    from ddiloco.run.root import RunRoot

    root = RunRoot.from_env(open_store(args.store), role="export")
    out = export_model(root, args.model, args.out)
    return emit(out)


SFT_FLAGS = ("base", "data", "steps", "batch_size", "lr", "replay_fraction", "seed", "device")
"""`ddiloco sft`'s flags that override the run's sft: section (None: not given)."""


def _on_run_root(sub: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand that works on a prepared run root (`--store`)."""
    p = sub.add_parser(name, help=help, description=description)
    p.add_argument("--store", required=True, help="run root, e.g. file:///dir/run or s3://bucket/prefix/run")
    return p


def _add_section_args(p: argparse.ArgumentParser, section: str, seed: str, example: str) -> None:
    """`--seed`, `--device` and `--set` of a command whose settings are the run's `section`."""
    p.add_argument(
        "--seed", type=int, default=None, help=f"{seed} (default: {section}.seed, else the run's seed)"
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default=None, help=f"(default: {section}.device)"
    )
    add_set_arg(p, example)


def register(sub: Any) -> None:
    """Add `evaluate`, `sft`, `report` and `export` to the `ddiloco` subcommands."""
    p = _on_run_root(
        sub,
        "evaluate",
        "validation loss, perplexity and downstream task accuracy of a checkpoint in the store",
        "Settings come from the run's eval: section, then --set eval.KEY=VALUE, then the flags below.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="final | latest | sft | round:N | learner:ID | a payload key (default: final, else latest)",
    )
    p.add_argument("--name", default=None, help="result name: writes eval/NAME.json (default from --model)")
    p.add_argument(
        "--tasks",
        type=_tasks,
        default=None,
        help="comma-separated task names (default: eval.tasks, else all); with --harness lm-eval also a "
        "directory of lm-eval task YAMLs (every task it defines runs)",
    )
    p.add_argument(
        "--harness",
        choices=["builtin", "lm-eval"],
        default="builtin",
        help="builtin: this package's evaluator (also validation loss); lm-eval: EleutherAI's "
        "lm-evaluation-harness on the checkpoint exported as a Hugging Face model, results in "
        "eval/lm-NAME.json",
    )
    p.add_argument("--items", type=int, default=None, help="items per task (default: eval.items_per_task)")
    _add_section_args(p, "eval", "task seed", "eval.items_per_task=50")
    p.set_defaults(func=cmd_evaluate)

    p = _on_run_root(
        sub,
        "sft",
        "fine-tune a checkpoint on prompt/response pairs; writes sft/model.safetensors to the store",
        "Settings come from the run's sft: section (defaults when it is null), then --set sft.KEY=VALUE, then "
        "the flags below.",
    )
    p.add_argument(
        "--data", default=None, help='JSONL of {"prompt", "response"} (default: sft.data, else built-in)'
    )
    p.add_argument(
        "--base", default=None, help="checkpoint to fine-tune, as evaluate --model (default: sft.base)"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: sft.steps)")
    p.add_argument("--batch-size", type=int, default=None, help="examples per step (default: sft.batch_size)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: sft.lr)")
    p.add_argument(
        "--replay-fraction",
        type=float,
        default=None,
        help="share of pre-training windows per batch (default: sft.replay_fraction)",
    )
    p.add_argument(
        "--skip-without-data",
        action="store_true",
        help="a user corpus without sft.data: warn and skip (evaluate --model sft then skips too) "
        "instead of failing",
    )
    _add_section_args(p, "sft", "seed of split and batches", "sft.steps=100")
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

    p = _on_run_root(
        sub,
        "export",
        "write a checkpoint as a Hugging Face directory (config, safetensors, tokenizer)",
        "The directory loads with transformers alone: AutoModelForCausalLM.from_pretrained(DIR) and "
        "AutoTokenizer.from_pretrained(DIR). A signed run's model is verified first.",
    )
    p.add_argument("--model", default="final", help="final | sft | latest | round:N (default: final)")
    p.add_argument("--out", required=True, help="local directory, file:///dir or s3://bucket/prefix")
    p.set_defaults(func=cmd_export)
