"""Learner tokens/s with and without the DiLoCo machinery, measured side by side in one run, by step count.

(a) plain: the same model, data loader and AdamW inner step in a bare loop (`_learner_bench.PlainLoop`);
(b) learner: `ddiloco.learner.loop.Learner` answering rounds of a real syncer process over a file:// store
    (snapshots, uploads, downloads and applies of new global versions, reports, checkpoints).
The two alternate for --repeats rounds so machine noise hits both; the last line is one JSON object.
`learner_throughput.py` measures the same by time, with MFU and GPU presets.

    python benchmarks/learner_overhead.py [--recipe tiny-cpu] [--steps 200] [--repeats 3] [--set k=v ...]
                                          [--hf-arch llama]   # a transformers model of the preset's size
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from _learner_bench import PlainLoop, hf_dir_like, prepared_run, sync

from ddiloco.config.recipes import load_config
from ddiloco.learner.loop import Learner
from ddiloco.platform.devices import resolve_device
from ddiloco.run.root import RunRoot


def tokens_per_s(fn, steps: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    tokens = sum(fn() for _ in range(steps))
    sync(device)
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny-cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument("--hf-arch", help="train a transformers model of this model_type (e.g. llama) instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fixed = ["diloco.token_budget=1000000000000", "diloco.learners=1"]
    cfg = load_config(args.recipe, None, [*args.overrides, *fixed])
    if args.hf_arch:
        path = hf_dir_like(cfg, args.hf_arch, tempfile.mkdtemp(prefix="ddiloco-hf-bench-"))
        cfg = load_config(args.recipe, None, [*args.overrides, *fixed, f"model.hf={path}"])
    cfg.run_id = "bench"
    device = resolve_device(cfg.train.device)
    with prepared_run(cfg) as (_, store):
        learner = Learner.open(store, 0)
        learner.start()
        plain = PlainLoop(store, cfg, device)

        def tick() -> int:
            learner.tick()
            return learner.loader.tokens_per_batch

        tokens_per_s(lambda: plain.run(1), 10, device)  # warm-up both paths
        tokens_per_s(tick, 10, device)
        plain_samples, learner_samples = [], []
        for _ in range(args.repeats):
            plain_samples.append(tokens_per_s(lambda: plain.run(1), args.steps, device))
            learner_samples.append(tokens_per_s(tick, args.steps, device))
        status = RunRoot(store, cfg.run_id).status()
        rounds_answered = learner.exchange.rounds_answered
        learner.close("max_steps")
    p, d = statistics.median(plain_samples), statistics.median(learner_samples)
    result = {
        "recipe": args.recipe,
        "model": args.hf_arch or "gpt",
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "tokens_per_s_plain": p,
        "tokens_per_s_learner": d,
        "overhead": 1 - d / p,
        "rounds_answered": rounds_answered,
        "rounds_merged": status.rounds_merged if status else None,
        "plain_samples": plain_samples,
        "learner_samples": learner_samples,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
