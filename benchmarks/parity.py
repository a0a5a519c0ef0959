"""Parity: data-parallel vs synchronous DiLoCo vs Decoupled DiLoCo at equal compute, over seeds, plus ablations.

Every configuration is a fresh run in its own temporary workdir, one at a time; every configuration runs once
per seed (`--seeds N`: seeds S … S+N−1, `--first-seed S`, 0 by default; the seed sets the initial model, the
data order and, for the synthetic corpus, the corpus itself), and rows of the same seed share corpus, shards (for
the same M) and initial model:

- `dp`: `ddiloco.baseline` — M gloo ranks, gradients all-reduced every step, global batch M × B.
- `sync`: the `sync-diloco` recipe — K = M, P = 1, H = 50, no grace window, fp32 uploads.
- `decoupled`: the `tiny-cpu` recipe with int4 uploads — K = 1 + adaptive grace, RDA, P = 4, H = 32.

Equal compute (`--compare compute`, the default). Users pay for the tokens their learners *process*. The
DiLoCo token budget counts *merged* tokens, and learners process more (answers a newer version overwrites are
discarded; ~9% at the recipe). So the data-parallel run of a seed processes exactly as many tokens as the
Decoupled DiLoCo run of the same seed processed (every learner's inner-step tokens, discarded ones included;
rounded up to one whole global batch, < M·B·T tokens), with its learning-rate schedule decaying over that
count: both spent the same compute. `--compare tokens` gives data-parallel the merged budget instead (equal
*merged* tokens: data-parallel then spends less compute). The sync DiLoCo row and the ablation rows have no
data-parallel run of their own; `proc/DP` (tokens processed over data-parallel's) shows how close to equal
compute their `vs DP %` is. The JSON's `compare` says which mode ran and data-parallel's tokens by seed.
(`--dp-tokens processed|budget` is the old name of `--compare compute|tokens`.)

Corpus (`--corpus`): `synthetic` (the recipe's generated world) or `python-docs`, real text nobody in this
project wrote: the Python documentation shipped with CPython (`ddiloco corpus python-docs`, `ddiloco.data.corpora`;
~1.9M characters, PSF License), written into `--workdir` (or a temporary directory) unless `--corpus-path`
names an existing file; byte tokenizer (the recipe's), so the model is the same on both corpora. The JSON's
`corpus` holds its sidecar (Python version, SHA-256).

Bytes. `bytes_per_learner` is what one learner *sends*: DiLoCo uploads (summary `bytes_uploaded` / M);
data-parallel, the ring all-reduce's 2(M−1)/M × the fp32 gradient bytes of every step. `bytes_x_vs_dp`
compares bytes per learner per token processed, so runs of slightly different length compare fairly.
`bytes_downloaded_per_learner` is what a DiLoCo learner receives (global versions, full or as download
deltas), and `total_bytes_x_vs_dp` compares up + down (data-parallel receives what it sends).

Ablations (`--ablations`, on top of the decoupled configuration; the matching reference run is reused):
`merge` (RDA vs token-weighted mean at M = 4 and 8, with ‖merged‖ / mean ‖Δ‖ over rounds with ≥ 2 answers),
`codec` (fp32, int8, int4, int2), `download` (diloco.download_codec none, int8, int4), `weighting` (token
weighting on/off with learner 0 at half batch), `fragments` (P = 1, 2, 4, 8), `sync_every` (H = 16, 32, 64),
`outer` (outer Nesterov, lr 0.7, momentum 0.9 — the recipe's — vs outer lr 1.0 without momentum).

    .venv/bin/python benchmarks/parity.py [--methods dp,sync,decoupled] [--ablations merge,codec,...|all]
        [--seeds N] [--compare compute|tokens] [--corpus synthetic|python-docs] [--corpus-path PATH]
        [--learners 4] [--tokens N] [--set key=value ...] [--json PATH] [--resume PATH.runs.jsonl]
        [--task-items N | --no-tasks] [--quick | --preset small]

Small-budget preset (`--preset small`): quality as a tracked property. Data-parallel and Decoupled DiLoCo,
3 seeds, equal compute, 2.5M merged tokens (~2.7M processed), H = 48, int4 uploads and the default int8
download deltas, M = 4, no downstream tasks: each fragment is merged only ~6-7 times, which is where a change to
pacing, the grace window, the schedule or the staleness rule shows (3.3 minutes on 2 cores with nothing else
running). Any option given explicitly wins over the preset's. Besides the tables and the full JSON, it prints
one line `{"small_budget": ...}`: the gap to data-parallel (mean, sd, min, max, by seed) and the mean losses;
`docs/results.md` §12 keeps one row per release. Not a CI test (asynchronous runs are not deterministic), but
the number every change to the learner or syncer is checked against before it lands.

Prints a table per comparison and seed, then the aggregate over seeds; the last line is one JSON object (also
written to --json PATH): `methods` (one entry per method and seed: method, seed, final_val_loss,
bytes_per_learner, wall_seconds, task_accuracy, tokens, ratios to data-parallel of the same seed, ...),
`ablations` (one list per ablation, a row per configuration and seed), `aggregate` (`methods` and
`ablations` as one row per configuration: mean, std, min, max and by-seed values of the loss and of the gap
to data-parallel; `_parity_stats.aggregate`), `checks` (the issue's targets evaluated on the aggregate),
`compare`, `corpus`, `seeds`, `machine`. Every finished run is also appended to PATH.runs.jsonl as it
completes; `--resume` reuses those runs (matched by training config) in a later invocation (with
`python-docs`, give `--workdir` or `--corpus-path` so the corpus path, part of the config, stays the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _parity_runs import Runner, Spec, merged, setting
from _parity_stats import AGGREGATE_COLUMNS, aggregate, checks, table, total_x_vs_dp, vs_dp
from _record import ROOT, checkout_commit, command_line

from ddiloco.baseline import ring_factor
from ddiloco.config.recipes import load_config
from ddiloco.config.run import EvalConfig, RunConfig, TrainConfig
from ddiloco.data.corpora import read_meta, write_python_docs

log = logging.getLogger("parity")

METHODS = ("dp", "sync", "decoupled")
ABLATIONS = ("merge", "codec", "download", "weighting", "fragments", "sync_every", "outer")
CORPORA = ("synthetic", "python-docs")
COMPARE = {"compute": "processed", "tokens": "budget"}  # --compare mode: its old --dp-tokens name
BATCH_OPTION = "learner_batch_sizes"  # train.<this>: per-learner batch sizes by learner id
DECOUPLED = ("diloco.codec=int4",)
PRESETS = {
    "small": {
        "methods": "dp,decoupled",
        "seeds": 3,
        "tokens": 2_500_000,
        "task_items": 0,
        "overrides": ["diloco.sync_every=48"],  # int4 uploads: DECOUPLED
    },
}
"""`--preset NAME`: defaults for options not given on the command line (overrides go first, `--set` wins)."""
QUICK = (
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.seq_len=32",
    "train.batch_size=4",
    "train.warmup_steps=2",
    "train.heartbeat_every_s=0.2",
    "data.synthetic_docs=600",
    "data.synthetic_entities=8",
    "diloco.fragments=2",
    "diloco.sync_every=4",
    "eval.val_batches=2",
)


# --- what to run ------------------------------------------------------------------------------------------
def posttrain_overrides(args: argparse.Namespace) -> list[str]:
    """Evaluation only: no SFT, `--task-items` items per task (at least 1: a run always evaluates tasks)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    out = ["sft=null"] if "sft" in fields else []
    if "items_per_task" in {f.name for f in dataclasses.fields(EvalConfig)}:
        out += [f"eval.items_per_task={max(1, args.task_items)}", "eval.curve_points=2"]
    return out


def base_overrides(args: argparse.Namespace, seed: int, learners: int | None = None) -> tuple[str, ...]:
    common = [*(QUICK if args.quick else ()), *posttrain_overrides(args), *args.corpus_overrides]
    common += [*args.overrides, f"diloco.learners={learners or args.learners}", f"seed={seed}"]
    if args.tokens:
        common += [f"diloco.token_budget={args.tokens}"]
    return merged(common)


def method_specs(args: argparse.Namespace, seed: int) -> dict[str, Spec]:
    base, M = base_overrides(args, seed), args.learners
    return {
        "dp": Spec("data-parallel", "dp", "tiny-cpu", base),
        "sync": Spec("sync DiLoCo", "diloco", "sync-diloco", merged(base, [f"diloco.quorum={M}"])),
        "decoupled": Spec("decoupled DiLoCo", "diloco", "tiny-cpu", merged(base, DECOUPLED)),
    }


def ablation_specs(args: argparse.Namespace, name: str, seed: int) -> list[Spec]:
    base = merged(base_overrides(args, seed), DECOUPLED)

    def d(label: str, *extra: str, learners: int | None = None) -> Spec:
        b = base if learners is None else merged(base_overrides(args, seed, learners), DECOUPLED)
        return Spec(label, "diloco", "tiny-cpu", merged(b, extra))

    if name == "merge":
        big = 8 if not args.quick else 3
        return [
            d(f"M={m} {merge}", *(("diloco.merge=mean",) if merge == "mean" else ()), learners=m)
            for m in sorted({args.learners, big})
            for merge in ("rda", "mean")
        ]
    if name == "codec":
        return [d(f"codec={c}", f"diloco.codec={c}") for c in ("fp32", "int8", "int4", "int2")]
    if name == "download":
        return [d(f"download={c}", f"diloco.download_codec={c}") for c in ("none", "int8", "int4")]
    if name == "weighting":
        B = setting(Spec("", "diloco", "tiny-cpu", base), "train.batch_size")
        sizes = [max(1, B // 2)] + [B] * (args.learners - 1)
        batches = f"train.{BATCH_OPTION}=[{','.join(map(str, sizes))}]"
        return [
            d(
                f"weighting {'on' if on else 'off'}",
                batches,
                f"diloco.token_weighting={'true' if on else 'false'}",
            )
            for on in (True, False)
        ]
    if name == "fragments":
        ps = (1, 2, 4, 8) if not args.quick else (1, 2)
        return [d(f"P={p}", f"diloco.fragments={p}", f"diloco.overlap={min(2, p)}") for p in ps]
    if name == "sync_every":
        hs = (16, 32, 64) if not args.quick else (4, 8)
        return [d(f"H={h}", f"diloco.sync_every={h}") for h in hs]
    if name == "outer":
        return [
            d("outer Nesterov lr 0.7 m 0.9", "diloco.outer_lr=0.7", "diloco.outer_momentum=0.9"),
            d("outer lr 1.0 no momentum", "diloco.outer_lr=1.0", "diloco.outer_momentum=0.0"),
        ]
    raise ValueError(name)


def dp_tokens_for(args: argparse.Namespace, decoupled: dict[str, Any] | None, spec: Spec) -> tuple[int, str]:
    """(tokens the data-parallel run processes, where that number comes from)."""
    if args.compare == "compute" and decoupled is not None:
        return decoupled["tokens_processed"], "processed by the Decoupled DiLoCo run of the same seed"
    why = "merged token budget" if args.compare == "tokens" else "merged token budget (no decoupled run)"
    return setting(spec, "diloco.token_budget"), why


def corpus_overrides(args: argparse.Namespace) -> tuple[list[str], dict[str, Any], Path | None]:
    """(`--set` overrides that select the corpus, its description for the JSON, a directory to remove)."""
    if args.corpus == "synthetic":
        return [], {"name": "synthetic"}, None
    made = None
    path = Path(args.corpus_path) if args.corpus_path else None
    if path is None:
        root = Path(args.workdir) if args.workdir else Path(made := tempfile.mkdtemp(prefix="parity-corpus-"))
        path = root / "python-docs.jsonl"
    if args.corpus_path is None or not path.exists():
        write_python_docs(path)
    path = path.resolve()
    info = {"name": args.corpus, "path": str(path), **(read_meta(path) or {})}
    info["file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()  # what the runs read (sidecar: built)
    return [f"data.source={path}", "data.tokenizer=byte"], info, Path(made) if made else None


def analytic_dp(spec: Spec, tokens: int, params: int) -> dict[str, Any]:
    """Data-parallel bytes per rank at the same M and tokens. They are deterministic (ring all-reduce of the
    fp32 gradients every step); `tests/unit/test_baseline.py` checks the counted bytes equal this formula."""
    cfg = load_config(spec.recipe, None, spec.overrides)
    M = cfg.diloco.learners
    steps = math.ceil(tokens / (M * cfg.train.batch_size * cfg.model.seq_len))
    return {
        "bytes_per_learner": steps * params * 4 * ring_factor(M),
        "tokens_processed": steps * M * cfg.train.batch_size * cfg.model.seq_len,
    }


def machine() -> dict[str, Any]:
    """`_record.this_machine()` (cores, CPU model, load) and the software the run used."""
    from _record import this_machine as cores_and_load

    return cores_and_load() | {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
    }


# --- main -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(arguments with defaults filled in, methods, ablations)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--methods", default=None, help=f"comma list of {', '.join(METHODS)}, or none (default: all three)"
    )
    ap.add_argument("--ablations", default="none", help=f"comma list of {', '.join(ABLATIONS)}, all, or none")
    ap.add_argument("--seeds", type=int, default=None, help="run every configuration for seeds S … S+N−1 (1)")
    ap.add_argument(
        "--first-seed", type=int, default=0, metavar="S", help="the first seed (0): more seeds later"
    )
    ap.add_argument(
        "--compare",
        choices=list(COMPARE),
        default=None,
        help="compute (default): data-parallel processes the decoupled run's processed tokens; "
        "tokens: the merged budget",
    )
    ap.add_argument("--dp-tokens", choices=list(COMPARE.values()), default=None, help="old name of --compare")
    ap.add_argument("--corpus", choices=CORPORA, default="synthetic", help="training text")
    ap.add_argument("--corpus-path", default=None, help="python-docs corpus file (built there if missing)")
    ap.add_argument("--learners", type=int, default=None, help="M (default 4; 2 with --quick)")
    ap.add_argument(
        "--tokens", type=int, default=None, help="token budget of every run (default: the recipe's)"
    )
    ap.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE")
    ap.add_argument("--task-items", type=int, default=None, help="items per task (0: no task accuracy)")
    ap.add_argument("--no-tasks", action="store_true", help="skip downstream task accuracy")
    ap.add_argument("--quick", action="store_true", help="a tiny smoke configuration (well under a minute)")
    ap.add_argument("--preset", choices=list(PRESETS), default=None, help="small: the small-budget check")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per configuration")
    ap.add_argument("--workdir", default=None, help="parent of the per-run temporary workdirs")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the JSON result here")
    ap.add_argument(
        "--record", default=None, metavar="CLAIM", help="also write docs/results/CLAIM.json (_record.py)"
    )
    ap.add_argument(
        "--resume", default=None, metavar="PATH.runs.jsonl", help="reuse runs an earlier --json recorded"
    )
    args = ap.parse_args(argv)
    if args.preset and args.quick:
        ap.error("--preset and --quick are two different configurations; give one")
    apply_preset(args)
    if args.compare and args.dp_tokens and COMPARE[args.compare] != args.dp_tokens:
        ap.error(f"--compare {args.compare} contradicts --dp-tokens {args.dp_tokens}; give --compare only")
    old = {v: k for k, v in COMPARE.items()}
    args.compare = args.compare or old.get(args.dp_tokens, "compute")
    args.dp_tokens = COMPARE[args.compare]
    if args.corpus_path and args.corpus != "python-docs":
        ap.error("--corpus-path applies to --corpus python-docs only")
    if args.seeds < 1 or args.first_seed < 0:
        ap.error("--seeds must be ≥ 1 and --first-seed ≥ 0")
    if any(o.split("=", 1)[0] == "seed" for o in args.overrides):
        ap.error("--set seed=… is chosen by --seeds and --first-seed; remove it")
    args.learners = args.learners or (2 if args.quick else 4)
    if args.quick and args.tokens is None:
        args.tokens = 24_000
    if args.task_items is None:
        args.task_items = 10 if args.quick else 100
    args.task_items = 0 if args.no_tasks else args.task_items
    methods = [] if args.methods == "none" else args.methods.split(",")
    ablations = (
        list(ABLATIONS)
        if args.ablations == "all"
        else ([] if args.ablations == "none" else args.ablations.split(","))
    )
    for name in methods:
        if name not in METHODS:
            ap.error(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    for name in ablations:
        if name not in ABLATIONS:
            ap.error(f"unknown ablation {name!r}; choose from {', '.join(ABLATIONS)}")
    return args, methods, ablations


def apply_preset(args: argparse.Namespace) -> None:
    """Fill the options the command line left unset from `--preset` (then the plain defaults)."""
    preset = PRESETS.get(args.preset or "", {})
    for name, default in (("methods", "dp,sync,decoupled"), ("seeds", 1), ("tokens", None)):
        if getattr(args, name) is None:
            setattr(args, name, preset.get(name, default))
    if args.task_items is None and "task_items" in preset:
        args.task_items = preset["task_items"]
    args.overrides = [*preset.get("overrides", []), *args.overrides]


def small_budget_line(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any] | None:
    """The preset's one-line summary: the decoupled gap to data-parallel over seeds and the mean losses."""
    agg = {a["method"]: a for a in out["aggregate"]["methods"]}
    dec, dp = agg.get("decoupled"), agg.get("dp")
    if dec is None or dp is None:
        return None
    gap = {k: dec.get(f"loss_vs_dp_pct{k}") for k in ("", "_std", "_min", "_max", "_by_seed")}
    return {
        "small_budget": {
            "corpus": args.corpus,
            "seeds": out["seeds"],
            "gap_vs_dp_pct": {"mean" if k == "" else k[1:]: v for k, v in gap.items()},
            "decoupled_loss": dec["final_val_loss"],
            "decoupled_loss_std": dec.get("final_val_loss_std"),
            "dp_loss": dp["final_val_loss"],
            "dp_loss_std": dp.get("final_val_loss_std"),
            "tokens_processed": dec.get("tokens_processed"),
            "overrides": args.overrides,
            "total_seconds": round(out["total_seconds"], 1),
        }
    }


def run_methods(
    args: argparse.Namespace,
    runner: Runner,
    methods: list[str],
    seed: int,
    out: dict[str, Any],
    tables: list[str],
) -> dict[str, Any] | None:
    """The method table of one seed (DiLoCo methods first, so data-parallel can match Decoupled DiLoCo's
    processed tokens); returns that seed's data-parallel row."""
    specs = method_specs(args, seed)
    rows: dict[str, dict[str, Any]] = {}
    for name in [m for m in METHODS if m in methods and m != "dp"]:
        rows[name] = dict(runner.get(specs[name]), seed=seed)
    dp_row = None
    if "dp" in methods:
        dp_tokens, source = dp_tokens_for(args, rows.get("decoupled"), specs["decoupled"])
        out["compare"]["dp_tokens_by_seed"][seed] = dp_tokens
        out["compare"]["dp_tokens_from"] = source
        dp_row = rows["dp"] = dict(runner.get(specs["dp"], dp_tokens), seed=seed)
    for row in rows.values():
        vs_dp(row, dp_row)
    entries = [
        {"method": name, "label": specs[name].label, **row}
        for name, row in sorted(rows.items(), key=lambda kv: METHODS.index(kv[0]))
    ]
    out["methods"] += entries
    if entries:
        title = f"methods (M={args.learners}, seed {seed}, {args.corpus}, compare = {args.compare})"
        tables.append(table(title, [(e["label"], e) for e in entries]))
    return dp_row


def run_ablation(
    args: argparse.Namespace, runner: Runner, name: str, seed: int, dp_row: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """The rows of ablation `name` for one seed, each against data-parallel and against its reference."""
    arows: list[dict[str, Any]] = []
    for spec in ablation_specs(args, name, seed):
        row = dict(runner.get(spec), seed=seed)
        # Bytes against data-parallel at this row's own M and tokens (exact: see analytic_dp).
        ref = analytic_dp(spec, row["tokens_processed"], row["model_params"])
        per_tok = row["bytes_per_learner"] / row["tokens_processed"]
        row["bytes_x_vs_dp"] = (ref["bytes_per_learner"] / ref["tokens_processed"]) / per_tok
        total_x_vs_dp(row, ref)
        if dp_row is not None and row["learners"] == dp_row["learners"]:
            row["loss_vs_dp_pct"] = 100 * (row["final_val_loss"] / dp_row["final_val_loss"] - 1)
            row["processed_vs_dp"] = row["tokens_processed"] / dp_row["tokens_processed"]
        base = next(r for r in arows + [row] if r["learners"] == row["learners"])
        row["loss_vs_ref_pct"] = 100 * (row["final_val_loss"] / base["final_val_loss"] - 1)
        arows.append({"config": spec.label, **row})
    return arows


def main(argv: list[str] | None = None) -> int:
    args, methods, ablations = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("ddiloco", "ddiloco.launch"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    started = time.time()
    args.corpus_overrides, corpus, made = corpus_overrides(args)
    runner = Runner(args)
    if args.resume:
        runner.resume(args.resume)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    out: dict[str, Any] = {
        "argv": command_line(),
        "commit": checkout_commit(ROOT),
        "machine": machine(),
        "args": vars(args),
        "seeds": seeds,
        "corpus": corpus,
        "compare": {"mode": args.compare, "dp_tokens_by_seed": {}},
        "methods": [],
        "ablations": {},
        "notes": [],
    }
    tables: list[str] = []
    dp_rows = {seed: run_methods(args, runner, methods, seed, out, tables) for seed in seeds}
    for name in ablations:
        if name == "weighting" and BATCH_OPTION not in {f.name for f in dataclasses.fields(TrainConfig)}:
            note = f"weighting ablation skipped: config has no train.{BATCH_OPTION} (per-learner batch sizes) yet"
            out["notes"].append(note)
            log.warning(note)
            continue
        out["ablations"][name] = []
        for seed in seeds:
            arows = run_ablation(args, runner, name, seed, dp_rows[seed])
            out["ablations"][name] += arows
            tables.append(table(f"ablation: {name} (seed {seed})", [(r["config"], r) for r in arows]))

    agg_methods = aggregate(out["methods"], key="method")
    dp_agg = next((a for a in agg_methods if a["method"] == "dp"), None)
    out["aggregate"] = {
        "methods": agg_methods,
        "ablations": {k: aggregate(v, dp=dp_agg) for k, v in out["ablations"].items()},
    }
    seeds_note = f"seeds {seeds[0]}…{seeds[-1]}" if len(seeds) > 1 else f"seed {seeds[0]}"
    if agg_methods:
        title = f"methods over {seeds_note} ({args.corpus}, compare = {args.compare}): mean, sd, min, max"
        tables.append(table(title, [(a["label"], a) for a in agg_methods], AGGREGATE_COLUMNS))
    for name, rows in out["aggregate"]["ablations"].items():
        tables.append(
            table(f"ablation: {name} over {seeds_note}", [(r["config"], r) for r in rows], AGGREGATE_COLUMNS)
        )
    out["checks"] = checks(agg_methods, out["aggregate"]["ablations"])
    out["total_seconds"] = time.time() - started
    out["machine"]["loadavg_end"] = os.getloadavg()
    if made is not None and not args.keep:
        shutil.rmtree(made, ignore_errors=True)
    for t in tables:
        print(t)
    for k, v in out["checks"].items():
        print(f"check {k}: {v}")
    if args.preset == "small" and (line := small_budget_line(args, out)) is not None:
        out["small_budget"] = line["small_budget"]
        print(json.dumps(line, sort_keys=True, default=str))
    text = json.dumps(out, sort_keys=True, default=str)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, sort_keys=True, default=str) + "\n")
    if args.record:
        from _record import record

        record(args.record, {"aggregate": out["aggregate"]}, out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
