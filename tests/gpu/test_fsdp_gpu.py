"""FSDP2 inside a learner on CUDA (`ddiloco.learner.fsdp`): bf16 mixed precision over NCCL, fragments in and
out of the shards, the memory a fragment read costs on the device.

One rank per GPU, up to two (a single GPU runs a world of one: the same code paths, no traffic). Run with
`pytest -m gpu tests/gpu`; every test is skipped without a CUDA device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ddiloco.learner.accel import train_step
from ddiloco.learner.fsdp import full_tensors, load_full, shard_model, state_bytes_per_rank
from ddiloco.model.gpt import GPT, GPTConfig, configure_optimizer, init_model
from ddiloco.platform.ports import free_port
from ddiloco.run.globalmodel import make_layout
from tests._ranks import spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS, B, T, LR, CLIP, FRAGMENTS = 20, 8, 64, 3e-3, 1.0, 6
CFG = dict(vocab_size=4099, block_size=T, n_layer=4, n_head=4, n_embd=128)  # odd rows: uneven shards


def _world() -> int:
    return min(2, torch.cuda.device_count())


def _meta_model() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**CFG))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    base = torch.randint(0, 64, (B, 1), generator=g)  # learnable: counting sequences from a random start
    rows = (base + torch.arange(T + 1)) % CFG["vocab_size"]
    return rows[:, :-1].cuda(), rows[:, 1:].cuda()


def _train(rank: int, precision: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float], list]:
    model = shard_model(init_model(GPTConfig(**CFG), 0, device="cuda"), mixed_precision=precision)
    seen: list = []
    model.transformer.h[0].attn.c_attn.register_forward_hook(lambda m, i, o: seen.append(str(o.dtype)))
    opt = configure_optimizer(model, LR, 0.1)
    losses = [float(train_step(model, opt, *_batch(rank, s), LR, CLIP)) for s in range(STEPS)]
    return model, opt, losses, seen


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        info: dict = {}
        _, _, info["fp32"], _ = _train(rank, "fp32")
        model, opt, info["bf16"], seen = _train(rank, "bf16")
        info["compute_dtypes"] = sorted(set(seen))
        info["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        info["state_bytes"] = state_bytes_per_rank(model, opt)

        layout = make_layout(_meta_model(), FRAGMENTS)
        mismatched, peaks = [], []
        for p, frag in enumerate(layout.fragments):
            g = torch.Generator().manual_seed(7 + p)
            values = {n: torch.randn(layout.shapes[n], generator=g) for n in frag.names}  # on the host
            load_full(model, values if rank == 0 else None)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            got = full_tensors(model, frag.names)
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - start)
            if rank == 0:
                assert got is not None
                mismatched += [n for n in frag.names if not torch.equal(got[n].cpu(), values[n])]
        info["mismatched"], info["peak_over_fragment"] = (
            mismatched,
            [
                peak / max(1, 4 * sum(torch.Size(layout.shapes[n]).numel() for n in f.names))
                for peak, f in zip(peaks, layout.fragments, strict=True)
            ],
        )
        Path(f"{out}/rank{rank}.json").write_text(json.dumps(info))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out, world = tmp_path_factory.mktemp("fsdp_gpu"), _world()
    spawn_ranks(_rank_main, (world, free_port(), str(out)), world, 300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_bf16_mixed_precision_computes_in_bf16_keeps_fp32_masters_and_tracks_fp32(runs):
    for info in runs:
        assert info["compute_dtypes"] == ["torch.bfloat16"]
        assert info["param_dtypes"] == ["torch.float32"]
        assert info["bf16"][-1] < info["bf16"][0] - 1.0  # it learns
        assert abs(info["bf16"][-1] - info["fp32"][-1]) <= 0.05 * info["fp32"][-1] + 0.05


def test_fragments_round_trip_over_nccl_and_a_read_costs_one_fragment_on_the_device(runs):
    assert runs[0]["mismatched"] == []
    for r, info in enumerate(runs):
        limit = 1.5 if r == 0 else 0.75  # rank 0 builds the fragment; the others send views of their shard
        assert max(info["peak_over_fragment"]) <= limit, (r, info["peak_over_fragment"])


def test_state_per_rank_shrinks_with_the_world(runs):
    model = _meta_model()
    whole = 16 * sum(p.numel() for p in model.parameters())
    for info in runs:
        assert info["state_bytes"] <= whole / len(runs) * 1.1 + 4096
