"""Learner tokens/s with and without the DiLoCo machinery, measured side by side in one run.

(a) plain: the same model, data loader and AdamW inner step in a bare loop;
(b) learner: `ddiloco.learner.Learner` answering rounds of a real syncer process over a file:// store
    (snapshots, uploads, downloads and applies of new global versions, reports, checkpoints).
The two alternate for --repeats rounds so machine noise hits both; the last line is one JSON object.

    python benchmarks/learner_overhead.py [--recipe tiny-cpu] [--steps 200] [--repeats 3] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ddiloco import wire
from ddiloco.config import load_config
from ddiloco.data import ShardLoader
from ddiloco.globalmodel import build_model, read_layout
from ddiloco.learner import Learner, inner_step, lr_at
from ddiloco.model import configure_optimizer
from ddiloco.prepare import load_tokens, prepare
from ddiloco.store import open_store


def plain_tokens_per_s(store, cfg, steps: int, state: dict) -> float:
    if "model" not in state:
        layout = read_layout(store)
        state["model"] = build_model(layout, cfg.seed)
        t = cfg.train
        state["opt"] = configure_optimizer(state["model"], t.lr, t.weight_decay, (t.beta1, t.beta2))
        state["loader"] = ShardLoader(
            load_tokens(store, wire.shard_key(0), cfg.run_id),
            batch_size=t.batch_size,
            seq_len=cfg.model.seq_len,
            seed=1,
        )
        state["step"] = 0
    model, opt, loader, t = state["model"], state["opt"], state["loader"], cfg.train
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = loader.next_batch()
        inner_step(model, opt, x, y, lr_at(state["step"], t.lr, t.warmup_steps), t.grad_clip)
        state["step"] += 1
    return steps * loader.tokens_per_batch / (time.perf_counter() - t0)


def learner_tokens_per_s(learner: Learner, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        learner.tick()
    return steps * learner.loader.tokens_per_batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny-cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(
        args.recipe, None, [*args.overrides, "diloco.token_budget=1000000000000", "diloco.learners=1"]
    )
    cfg.run_id = "bench"
    with tempfile.TemporaryDirectory() as tmp:
        url = f"file://{tmp}/bench"
        store = open_store(url)
        prepare(store, cfg)
        syncer = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", "syncer", "--store", url],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            learner = Learner(store, 0)
            learner.start()
            plain_state: dict = {}
            plain_tokens_per_s(store, cfg, 10, plain_state)  # warm-up both paths
            learner_tokens_per_s(learner, 10)
            plain, diloco = [], []
            for _ in range(args.repeats):
                plain.append(plain_tokens_per_s(store, cfg, args.steps, plain_state))
                diloco.append(learner_tokens_per_s(learner, args.steps))
            status = store.get_json_or_none(wire.STATUS) or {}
            rounds_answered = learner.rounds_answered
            learner._finish("max_steps")
        finally:
            syncer.kill()
            syncer.wait()
    p, d = statistics.median(plain), statistics.median(diloco)
    result = {
        "recipe": args.recipe,
        "steps_per_repeat": args.steps,
        "repeats": args.repeats,
        "tokens_per_s_plain": p,
        "tokens_per_s_learner": d,
        "overhead": 1 - d / p,
        "rounds_answered": rounds_answered,
        "rounds_merged": status.get("rounds_merged"),
        "plain_samples": plain,
        "learner_samples": diloco,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
