"""DDP against FSDP2 inside one learner: the same training, the loss it reaches, the state each rank keeps.

Two gloo ranks on the CPU (spawned with `torch.multiprocessing`), the same seeded model, the same batches
(bytes of the built-in synthetic corpus, a different seeded stream per rank), AdamW as
`ddiloco.model.gpt.configure_optimizer` builds it with the learner's defaults, the learner's step
(`ddiloco.learner.accel.train_step`: gradient clipping included, which under FSDP2 runs on DTensor
gradients) and a linear warm-up to train.lr. Run once with DDP and once with FSDP2
(`ddiloco.learner.fsdp.shard_model`). ``loss_*`` is the mean over ranks of the last 5 steps' losses;
``state_bytes_per_rank_*`` is `ddiloco.learner.fsdp.state_bytes_per_rank` (parameters, gradients, AdamW
state) on rank 0; ``seconds_per_step_*`` excludes the first 3 steps. ``--model hf-llama`` trains a tiny
Llama (`transformers.AutoConfig.for_model("llama")`, wrapped as `ddiloco.model.hf.model.HFCausalLM`).
Prints one JSON object as its last line.

    .venv/bin/python benchmarks/fsdp_parity.py --model gpt
    .venv/bin/python benchmarks/fsdp_parity.py --model hf-llama
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddiloco.config.run import TrainConfig
from ddiloco.data.synthetic import make_world, synthetic_documents
from ddiloco.learner.accel import train_step
from ddiloco.learner.fsdp import shard_model, state_bytes_per_rank
from ddiloco.model.gpt import GPTConfig, configure_optimizer, init_model
from ddiloco.platform.ports import free_port

WORLD, WARMUP, SKIP, LAST = 2, 10, 3, 5


def build(model: str, layers: int, width: int, seq: int, seed: int) -> torch.nn.Module:
    if model == "gpt":
        return init_model(
            GPTConfig(vocab_size=256, block_size=seq, n_layer=layers, n_head=4, n_embd=width), seed
        )
    from transformers import AutoConfig

    from ddiloco.model.hf.model import HFSpec, init_hf

    cfg = AutoConfig.for_model(
        "llama", vocab_size=256, hidden_size=width, intermediate_size=width * 8 // 3, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
    )  # fmt: skip
    return init_hf(HFSpec(hf_config=cfg.to_dict(), block_size=seq, vocab_size=256), seed)


def corpus() -> torch.Tensor:
    text = "\n".join(synthetic_documents(make_world(0), 0, 3000))
    return torch.tensor(list(text.encode()), dtype=torch.int64)


def _rank(rank: int, port: int, mode: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    t = TrainConfig()
    model = build(args.model, args.layers, args.width, args.seq, seed=0)
    if mode == "ddp":
        net: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        net = shard_model(model, mixed_precision=args.precision)
    opt = configure_optimizer(model, t.lr, t.weight_decay, (t.beta1, t.beta2))
    tokens, gen = corpus(), torch.Generator().manual_seed(1000 + rank)
    losses, times = [], []
    for step in range(args.steps):
        starts = torch.randint(0, tokens.numel() - args.seq - 1, (args.batch,), generator=gen)
        rows = torch.stack([tokens[s : s + args.seq + 1] for s in starts.tolist()])
        t0 = time.perf_counter()
        lr = t.lr * min(1.0, (step + 1) / WARMUP)
        loss = train_step(net, opt, rows[:, :-1], rows[:, 1:], lr, t.grad_clip)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    last = torch.tensor(sum(losses[-LAST:]) / LAST, dtype=torch.float64)
    dist.all_reduce(last)
    row = {
        "loss": float(last) / WORLD,
        "state_bytes": state_bytes_per_rank(model, opt),
        "seconds_per_step": sum(times[SKIP:]) / len(times[SKIP:]),
    }
    Path(f"{out}/{mode}.{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def _run(mode: str, args: argparse.Namespace) -> dict:
    mp.start_processes(_rank, args=(free_port(), mode, args, args.out), nprocs=WORLD, start_method="spawn")
    return json.loads(Path(f"{args.out}/{mode}.0.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("gpt", "hf-llama"), default="gpt")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="FSDP2 mixed precision")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default="/tmp/fsdp_parity")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    ddp, fsdp = _run("ddp", args), _run("fsdp", args)
    result = {
        "model": args.model,
        "precision": args.precision,
        "world": WORLD,
        "steps": args.steps,
        "loss_ddp": round(ddp["loss"], 6),
        "loss_fsdp": round(fsdp["loss"], 6),
        "loss_rel_diff": abs(fsdp["loss"] - ddp["loss"]) / abs(ddp["loss"]),
        "state_bytes_per_rank_ddp": ddp["state_bytes"],
        "state_bytes_per_rank_fsdp": fsdp["state_bytes"],
        "state_bytes_per_rank_ratio": round(fsdp["state_bytes"] / ddp["state_bytes"], 4),
        "seconds_per_step_ddp": round(ddp["seconds_per_step"], 4),
        "seconds_per_step_fsdp": round(fsdp["seconds_per_step"], 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
