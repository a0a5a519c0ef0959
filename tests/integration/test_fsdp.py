"""FSDP2 inside a learner (`ddiloco.learner.fsdp`) on two gloo ranks (real processes): exact training, whole
fragments in and out of the shards, half the state per rank.

One launch of two ranks runs every scenario and writes what the assertions need to a scratch directory
(written by this harness, not by the library); the tests read it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ddiloco.learner.accel import train_step
from ddiloco.learner.fsdp import full_tensors, load_full, shard_model, state_bytes_per_rank
from ddiloco.model.gpt import GPTConfig, configure_optimizer, init_model
from ddiloco.platform.ports import free_port
from ddiloco.run.globalmodel import make_layout
from tests._ranks import spawn_ranks

WORLD, STEPS, B, T = 2, 3, 4, 32
LR, CLIP, FRAGMENTS = 1e-2, 0.5, 6
CFG = dict(vocab_size=257, block_size=T, n_layer=2, n_head=4, n_embd=32)  # 257 rows: uneven shards


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    rows = torch.randint(0, CFG["vocab_size"], (B, T + 1), generator=g)
    return rows[:, :-1], rows[:, 1:]


def _train(rank: int, **shard: object) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
    model = shard_model(init_model(GPTConfig(**CFG), 0), **shard)  # type: ignore[arg-type]
    opt = configure_optimizer(model, LR, 0.1)
    losses = [float(train_step(model, opt, *_batch(rank, s), LR, CLIP)) for s in range(STEPS)]
    return model, opt, losses


def _fragment_values(names: list[str], shapes: dict[str, list[int]], p: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + p)
    return {n: torch.randn(shapes[n], generator=g) for n in names}


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        info: dict = {}
        model, opt, info["losses"] = _train(rank)
        info["state_bytes"] = state_bytes_per_rank(model, opt)
        names = [n for n, _ in model.named_parameters()]
        trained = full_tensors(model, names)
        ckpt, _, _ = _train(rank, checkpoint_activations=True, reshard_after_forward=False)
        ckpt_full = full_tensors(ckpt, names)
        _, _, info["bf16_losses"] = _train(rank, mixed_precision="bf16")

        # Every fragment of a layout with row pieces (P = 6): load rank 0's values, read them back.
        layout = make_layout(init_model(GPTConfig(**CFG), 0), FRAGMENTS)
        info["pieces"] = sorted(layout.pieces)
        params, expected, back = dict(model.named_parameters()), {}, {}
        for p, frag in enumerate(layout.fragments):
            values = _fragment_values(frag.names, layout.shapes, p)  # every rank knows them: checks its rows
            expected.update(values)
            loaded = load_full(model, values if rank == 0 else None)
            assert loaded == list(frag.names)
            got = full_tensors(model, frag.names)
            if rank == 0:
                back.update({f"{n}@{p}": v for n, v in got.items()})
        full = layout.assemble(expected)
        for n, v in full.items():  # this rank's local rows equal the loaded values' rows
            local = params[n].to_local()
            c = -(-v.shape[0] // WORLD)
            assert torch.equal(local, v[rank * c : rank * c + local.shape[0]]), n
        final = full_tensors(model, names)
        if rank == 0:
            save_file(trained, f"{out}/trained.safetensors")
            save_file(ckpt_full, f"{out}/ckpt.safetensors")
            save_file(back, f"{out}/back.safetensors")
            save_file(final, f"{out}/final.safetensors")
            save_file({n: v.contiguous() for n, v in expected.items()}, f"{out}/expected.safetensors")
        else:
            assert trained is None and final is None
        Path(f"{out}/rank{rank}.json").write_text(json.dumps(info))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("fsdp")
    spawn_ranks(_rank_main, (free_port(), str(out)), WORLD, 120)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _reference() -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float], list[float]]:
    """One process, each step on rank 0's and rank 1's batches concatenated; the gradient norms before
    clipping."""
    ref = init_model(GPTConfig(**CFG), 0)
    opt = configure_optimizer(ref, LR, 0.1)
    losses, norms = [], []
    for step in range(STEPS):
        batches = [_batch(r, step) for r in range(WORLD)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        for group in opt.param_groups:
            group["lr"] = LR
        _, loss = ref(x, y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return ref, opt, losses, norms


def test_two_sharded_ranks_match_one_process_on_the_concatenated_batch(runs):
    out, info = runs
    ref, _, losses, norms = _reference()
    assert max(norms) > CLIP  # clipping (on DTensor gradients under FSDP2) really acted
    for name in ("trained", "ckpt"):  # plain, and activation checkpointing without resharding
        got = load_file(str(out / f"{name}.safetensors"))
        for n, v in ref.named_parameters():
            torch.testing.assert_close(got[n], v.detach(), rtol=1e-4, atol=1e-5, msg=f"{name}: {n}")
    mean = [(a + b) / 2 for a, b in zip(info[0]["losses"], info[1]["losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    bf16 = [(a + b) / 2 for a, b in zip(info[0]["bf16_losses"], info[1]["bf16_losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(losses), rtol=1e-2, atol=0)  # bf16 on CPU


def test_full_tensors_returns_what_load_full_loaded_for_every_fragment(runs):
    out, info = runs
    assert info[0]["pieces"]  # the layout cuts the embedding and head into row pieces
    expected = load_file(str(out / "expected.safetensors"))
    back = load_file(str(out / "back.safetensors"))
    assert {k.split("@")[0] for k in back} == set(expected)
    for key, v in back.items():
        assert torch.equal(v, expected[key.split("@")[0]]), key
    final = load_file(str(out / "final.safetensors"))  # loading a fragment left the others alone
    layout = make_layout(init_model(GPTConfig(**CFG), 0), FRAGMENTS)
    for n, v in layout.assemble(expected).items():
        assert torch.equal(final[n], v), n


def test_each_rank_keeps_about_half_the_state_of_an_unsharded_learner(runs):
    _, info = runs
    ref, opt, _, _ = _reference()
    whole = state_bytes_per_rank(ref, opt)
    n = sum(p.numel() for p in ref.parameters())
    assert 0 <= whole - 16 * n <= 4 * len(list(ref.parameters()))  # fp32 weights, grads, 2 moments (+ steps)
    for r in range(WORLD):
        assert info[r]["state_bytes"] / whole <= 0.6, (r, info[r]["state_bytes"], whole)
