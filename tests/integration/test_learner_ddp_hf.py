"""DDP inside a learner with a Hugging Face model (gloo, two real rank processes): a mixture-of-experts
Mixtral (routers, experts as 3-D parameters, rotary buffers, tied nothing). Both ranks stay identical, and
equal one process stepping on the two ranks' batches concatenated, as `test_learner_ddp` checks for the
built-in GPT. (A dense Llama passes the same test, 18 s; it is the same code path without the router.)"""

from __future__ import annotations

import pytest
import torch

from ddiloco.data.loader import ShardLoader
from ddiloco.learner import ddp
from ddiloco.learner.accel import train_step
from ddiloco.model.gpt import configure_optimizer
from ddiloco.run.globalmodel import build_model, read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.run.schedule import lr_at
from ddiloco.store.url import open_store
from tests._harness import tiny_config
from tests._hf import tiny_hf_dir
from tests.integration.test_learner_ddp import STEPS, WORLD, _launch, _params

pytest.importorskip("transformers")


def test_two_ranks_of_a_mixture_of_experts_model_match_one_process_on_the_concatenated_batch(tmp_path):
    model_type = "mixtral"
    d = tiny_hf_dir(tmp_path / model_type, model_type)
    url = f"file://{tmp_path}/store/ddp-hf"
    cfg = tiny_config(
        f"ddp-{model_type}", "diloco.learners=1", "train.ranks=2", "train.checkpoint_every_s=0",
        "diloco.token_budget=6000", "model.seq_len=32", f"model.hf={d}",
    )  # fmt: skip
    store = open_store(url)
    prepare(store, cfg)
    t, B = cfg.train, cfg.train.batch_size

    got = _launch(url, tmp_path / "a", STEPS)
    assert got[0]["reason"] == "max_steps" and got[0]["steps"] == got[1]["steps"] == STEPS
    p0, p1 = _params(tmp_path / "a", 0), _params(tmp_path / "a", 1)
    assert all(torch.equal(p0[n], p1[n]) for n in p0)

    layout = read_layout(store)
    ref = build_model(layout, cfg.seed)
    named = dict(ref.named_parameters())
    with torch.no_grad():
        for p in range(layout.num_fragments):
            for n, v in RunRoot(store, cfg.run_id).read_global(layout, p, 0).items():
                named[n].copy_(v)
    opt = configure_optimizer(ref, t.lr, t.weight_decay, (t.beta1, t.beta2))
    tokens = RunRoot(store, cfg.run_id).shard(0)
    b = ddp.slice_bounds(tokens.numel(), WORLD)
    loaders = [
        ShardLoader(tokens[b[r] : b[r + 1]], batch_size=B, seq_len=32, seed=ddp.rank_seed(cfg.seed * 1000, r))
        for r in range(WORLD)
    ]
    start = {n: v.detach().clone() for n, v in named.items()}
    for step in range(STEPS):
        batches = [ld.next_batch() for ld in loaders]
        x, y = torch.cat([xb for xb, _ in batches]), torch.cat([yb for _, yb in batches])
        train_step(ref, opt, x, y, lr_at(step, t.lr, t.warmup_steps), t.grad_clip)
    trained = [n for n, v in named.items() if not torch.equal(v, start[n])]
    assert len(trained) > len(named) // 2
    for n, v in named.items():
        torch.testing.assert_close(p0[n], v.detach(), rtol=1e-4, atol=1e-5, msg=n)
