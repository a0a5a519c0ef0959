"""Parity benchmark, running one configuration: `Spec` (what to run), `run_diloco` / `run_dp`, and `Runner`
(each distinct training run once, in a fresh temporary workdir; finished runs appended to PATH.runs.jsonl and
reused by `--resume`).

Design choices:
- A run's identity is its resolved training config (evaluation settings excluded) plus data-parallel's token
  count, so equal trainings run once: an ablation's reference row and the method table's Decoupled DiLoCo row
  of the same seed are one run.
- Every row records the seed it trained with (`seed`), so rows of several seeds can be told apart and
  aggregated (`_parity_stats.aggregate`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.baseline import run_baseline
from ddiloco.config.recipes import load_config
from ddiloco.launch import LocalRun
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store

log = logging.getLogger("parity")


def merged(*groups: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Overrides in order with one entry per key (the last value wins), so commands read cleanly."""
    out: dict[str, str] = {}
    for item in (o for g in groups for o in g):
        out[item.split("=", 1)[0]] = item
    return tuple(out.values())


@dataclass(frozen=True, slots=True)
class Spec:
    label: str
    """Row name in its table."""
    kind: str
    """`dp` or `diloco`."""
    recipe: str
    overrides: tuple[str, ...]
    """Everything on top of the recipe (the common --set overrides included), as `--set` would take them."""

    def key(self, dp_tokens: int | None = None) -> str:
        """Identity of the training run: the resolved config minus evaluation settings, so equal trainings
        run once (and --resume matches runs recorded with other evaluation settings)."""
        d = load_config(self.recipe, None, self.overrides).to_dict()
        d = {k: v for k, v in d.items() if k not in ("run_id", "eval", "sft")}
        return json.dumps([self.kind, d, dp_tokens], sort_keys=True)

    @classmethod
    def from_command(cls, command: str) -> tuple[Spec, int | None]:
        """The inverse of `command` (for --resume)."""
        words = shlex.split(command)
        opts = [(words[i], words[i + 1]) for i in range(len(words) - 1) if words[i].startswith("--")]
        tokens = next((int(v) for k, v in opts if k == "--tokens"), None)
        kind = "dp" if words[1] == "baseline" else "diloco"
        recipe = next(v for k, v in opts if k == "--recipe")
        return cls("", kind, recipe, tuple(v for k, v in opts if k == "--set")), tokens

    def command(self, dp_tokens: int | None = None) -> str:
        sets = " ".join(f"--set {o}" for o in self.overrides)
        if self.kind == "dp":
            return f"ddiloco baseline --prepare --store file:///tmp/dp --recipe {self.recipe} {sets} --tokens {dp_tokens}"
        return f"ddiloco run --recipe {self.recipe} {sets}"


def setting(spec: Spec, key: str) -> Any:
    """One resolved config value, e.g. `diloco.token_budget` or `seed`."""
    value: Any = load_config(spec.recipe, None, spec.overrides)
    for name in key.split("."):
        value = getattr(value, name)
    return value


# --- running one configuration ----------------------------------------------------------------------------
def round_stats(records: list[dict[str, Any]], learners: int) -> dict[str, Any]:
    """‖merged‖ / weighted mean ‖Δ_m‖ over rounds with at least two answers (one answer is trivially 1)."""
    multi = [r for r in records if r["quorum"] >= 2]
    full = [r for r in records if r["quorum"] >= learners]

    def mean(rs: list[dict], k: str) -> float | None:
        return statistics.fmean(r[k] for r in rs) if rs else None

    return {
        "rounds": len(records),
        "rounds_multi": len(multi),
        "rounds_all_learners": len(full),
        "mean_answers": mean(records, "quorum"),
        # Inner steps per answer = steps between two receipts of the same fragment: the effective H.
        "steps_per_answer": statistics.fmean(
            c["c_steps"] for r in records for c in r["contributors"].values()
        )
        if records
        else None,
        "norm_ratio": mean(multi, "ratio"),
        "norm_ratio_all_learners": mean(full, "ratio"),
        "merged_norm": mean(multi, "merged_norm"),
        "mean_delta_norm": mean(multi, "mean_delta_norm"),
    }


def mean_accuracy(acc: dict[str, float] | None) -> float | None:
    return statistics.fmean(acc.values()) if acc else None


def _run_fields(cfg: Any, s: dict[str, Any], elapsed: float) -> dict[str, Any]:
    """The fields every run records first, DiLoCo or data-parallel, from its summary `s` (as JSON)."""
    return {
        "seed": cfg.seed,
        "final_val_loss": s["final_val_loss"],
        "initial_val_loss": s["initial_val_loss"],
        "wall_seconds": s["wall_seconds"],
        "elapsed_seconds": elapsed,
        "tokens_processed": s["tokens_processed"],
    }


def run_diloco(spec: Spec, workdir: Path, timeout: float, tasks: int) -> dict[str, Any]:
    cfg = load_config(spec.recipe, None, spec.overrides)
    cfg.run_id = "parity"
    run = LocalRun(cfg, workdir)
    t0 = time.time()
    s = run.run(timeout=timeout)  # evaluates the final model (val loss, tasks: issue 5) into the summary
    elapsed = time.time() - t0
    records = [run.store.get_json(k) for k in run.store.list("syncer/rounds/")]
    M, d = cfg.diloco.learners, cfg.diloco
    out = {
        **_run_fields(cfg, s.to_json(), elapsed),
        "tokens_merged": s.tokens_merged,
        "bytes_per_learner": s.bytes_uploaded / M,
        "bytes_downloaded_per_learner": s.bytes_downloaded / M,
        "goodput": s.goodput,
        "merged_token_share": s.merged_token_share,
        "learners": M,
        "quorum": d.quorum,
        "fragments": d.fragments,
        "sync_every": d.sync_every,
        "codec": d.codec,
        "download_codec": getattr(d, "download_codec", "none"),
        "merge": d.merge,
        "token_weighting": d.token_weighting,
        "grace": d.grace is not None,
        "model_params": s.model_params,
        "ledger_balanced": s.ledger_balanced,
        **round_stats(records, M),
    }
    if tasks:
        acc = s.task_accuracy
        out.update(task_accuracy=mean_accuracy(acc), task_accuracies=acc)
    return out


def run_dp(spec: Spec, workdir: Path, timeout: float, tasks: int, tokens: int) -> dict[str, Any]:
    cfg = load_config(spec.recipe, None, spec.overrides)
    cfg.run_id = "parity-dp"
    url = f"file://{workdir.resolve()}/{cfg.run_id}"
    store = open_store(url)
    t0 = time.time()
    prepare(store, cfg)
    s = run_baseline(url, learners=cfg.diloco.learners, tokens=tokens, timeout=timeout, tasks=bool(tasks))
    elapsed = time.time() - t0
    out = {
        **_run_fields(cfg, s, elapsed),
        "tokens_merged": s["tokens_processed"],
        "bytes_per_learner": s["bytes_sent_per_rank"],
        "bytes_allreduced_per_rank": s["bytes_allreduced_per_rank"],
        "ring_factor": s["ring_factor"],
        "steps": s["steps"],
        "global_batch": s["global_batch"],
        "learners": s["learners"],
        "model_params": s["model_params"],
        "params_identical": s["params_identical"],
    }
    if tasks:  # scored like `ddiloco run` scores its final model: the same task items (cfg.eval)
        out.update(task_accuracy=mean_accuracy(s["task_accuracy"]), task_accuracies=s["task_accuracy"])
    return out


class Runner:
    """Runs each distinct configuration once, in a fresh temporary workdir, and remembers the result."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.done: dict[tuple, dict[str, Any]] = {}

    def resume(self, path: str) -> None:
        """Reuse the finished runs recorded in a `--json PATH.runs.jsonl` file of an earlier invocation."""
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            spec, dp_tokens = Spec.from_command(rec["command"])
            self.done[spec.key(dp_tokens)] = rec
        log.info("resumed %d finished runs from %s", len(self.done), path)

    def get(self, spec: Spec, dp_tokens: int | None = None) -> dict[str, Any]:
        key = spec.key(dp_tokens)
        if key in self.done:
            return self.done[key]
        log.info("running %s (seed %s): %s", spec.label, setting(spec, "seed"), spec.command(dp_tokens))
        root = Path(self.args.workdir) if self.args.workdir else None
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="parity-", dir=root))
        load0 = os.getloadavg()[0]
        try:
            if spec.kind == "dp":
                res = run_dp(spec, workdir, self.args.timeout, self.args.task_items, dp_tokens or 0)
            else:
                res = run_diloco(spec, workdir, self.args.timeout, self.args.task_items)
        except BaseException:
            log.error("%s failed; its run directory (logs included) is kept at %s", spec.label, workdir)
            raise
        if not self.args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        res.update(command=spec.command(dp_tokens), loadavg_start=load0, loadavg_end=os.getloadavg()[0])
        log.info(
            "%s (seed %s): val loss %.4f, %.0fs wall, %.3g bytes/learner",
            spec.label,
            res["seed"],
            res["final_val_loss"],
            res["wall_seconds"],
            res["bytes_per_learner"],
        )
        self.done[key] = res
        if self.args.json:  # a long invocation that dies later still leaves every finished run behind
            with open(f"{self.args.json}.runs.jsonl", "a") as f:
                f.write(json.dumps({"label": spec.label, **res}, default=str) + "\n")
        return res
