"""The data-parallel baseline: two real gloo ranks, checked against one process training on the joint batch."""

import math

import pytest
import torch

from ddiloco import keys
from ddiloco.baseline import (
    load_baseline_model,
    load_initial_model,
    ring_factor,
    run_baseline,
)
from ddiloco.data.loader import ShardLoader
from ddiloco.errors import ConfigError
from ddiloco.learner.accel import train_step
from ddiloco.model.gpt import configure_optimizer
from ddiloco.run.globalmodel import read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.run.schedule import inner_lr, progress_of
from ddiloco.store.url import open_store
from tests._harness import tiny_config


def test_ring_factor_is_two_m_minus_one_over_m():
    assert [ring_factor(m) for m in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]


def test_memory_store_is_refused_with_a_hint():
    with pytest.raises(ConfigError, match="file:// or s3://"):
        run_baseline("memory://nowhere/run")


def test_two_gloo_ranks_match_one_process_on_the_joint_batch(tmp_path):
    cfg = tiny_config("dp", "train.warmup_steps=3")
    url = f"file://{tmp_path}/dp"
    store = open_store(url)
    prepare(store, cfg)
    M, B, T = 2, cfg.train.batch_size, cfg.model.seq_len
    tokens = 9 * M * B * T - 5  # not a whole number of global batches: rounds up to 9 steps

    s = run_baseline(url, learners=M, tokens=tokens, timeout=120, tasks=False)

    assert s["status"] == "done" and s["backend"] == "gloo" and s["learners"] == M
    assert s["steps"] == math.ceil(tokens / (M * B * T)) == 9
    assert s["tokens_processed"] == 9 * M * B * T
    payload = s["steps"] * s["model_params"] * 4  # every fp32 gradient, once per step
    assert s["bytes_allreduced_per_rank"] == payload
    assert s["bytes_sent_per_rank"] == payload * 2 * (M - 1) / M
    assert s["bytes_uploaded"] == M * s["bytes_sent_per_rank"]
    assert s["params_identical"]
    assert s["final_val_loss"] < s["initial_val_loss"]
    assert store.get_json(keys.BASELINE_SUMMARY) == s
    reports = [store.get_json(keys.baseline_rank_key(r)) for r in range(M)]
    assert len({r["params_sha256"] for r in reports}) == 1
    assert all(r["allreduce_calls"] >= s["steps"] for r in reports)

    # Reference: one process, the two ranks' batches concatenated, the learner's own inner step and schedule
    # (issue 17 item 6): progress = tokens processed before the step / the tokens the baseline trains for.
    layout = read_layout(store)
    ref = load_initial_model(store, cfg, layout)
    t = cfg.train
    opt = configure_optimizer(ref, t.lr, t.weight_decay, (t.beta1, t.beta2))
    loaders = [
        ShardLoader(
            RunRoot(store, cfg.run_id).shard(r),
            batch_size=B,
            seq_len=T,
            seed=cfg.seed * 1000 + r,
        )
        for r in range(M)
    ]
    for step in range(s["steps"]):
        batches = [ld.next_batch() for ld in loaders]
        x = torch.cat([b[0] for b in batches])  # (M·B, T)
        y = torch.cat([b[1] for b in batches])  # (M·B, T)
        train_step(ref, opt, x, y, inner_lr(progress_of(step * M * B * T, tokens), step, t), t.grad_clip)
    dp = load_baseline_model(store, cfg.run_id, layout)
    for (name, a), (_, b) in zip(sorted(dp.named_parameters()), sorted(ref.named_parameters()), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"{name} differs from the reference")
    assert store.exists(keys.BASELINE_MODEL)
    last = inner_lr(progress_of((s["steps"] - 1) * M * B * T, tokens), s["steps"] - 1, t)
    assert t.lr_schedule == "auto" and last < 0.25 * t.lr  # data-parallel decays (cosine): 8/9 of the budget
    assert all(r["last_lr"] == last for r in reports)


def test_the_baseline_trains_at_the_learners_precision(tmp_path):
    """bf16 autocast, as a learner on a GPU by default (`train.precision`), not fp32 whatever the learners
    did: a gloo rank with `train.precision=bf16` trains what one process with the learner's bf16 step does."""
    cfg = tiny_config("dp-bf16", "train.warmup_steps=3", "train.precision=bf16")
    url = f"file://{tmp_path}/dp-bf16"
    store = open_store(url)
    prepare(store, cfg)
    B, T = cfg.train.batch_size, cfg.model.seq_len
    s = run_baseline(url, learners=1, tokens=6 * B * T, timeout=120, tasks=False)
    assert s["precision"] == "bf16" and s["steps"] == 6

    layout, t = read_layout(store), cfg.train
    ref = load_initial_model(store, cfg, layout)
    opt = configure_optimizer(ref, t.lr, t.weight_decay, (t.beta1, t.beta2))
    loader = ShardLoader(RunRoot(store, cfg.run_id).shard(0), batch_size=B, seq_len=T, seed=cfg.seed * 1000)
    for step in range(s["steps"]):
        x, y = loader.next_batch()
        lr = inner_lr(progress_of(step * B * T, 6 * B * T), step, t)
        train_step(ref, opt, x, y, lr, t.grad_clip, precision="bf16")
    dp = load_baseline_model(store, cfg.run_id, layout)
    for (name, a), (_, b) in zip(sorted(dp.named_parameters()), sorted(ref.named_parameters()), strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"{name} differs from the bf16 reference")
