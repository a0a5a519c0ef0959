"""Cost of reading one fragment's full values out of an FSDP2-sharded model, and of loading one back.

Three ways of reading fragment ``--fragment`` of a GPT's layout (P = ``--fragments``) onto rank 0, each in
a fresh pair of gloo ranks (2 processes, CPU) so that peak memory is the method's own:
``rows`` (`ddiloco.learner.fsdp.full_tensors`: each rank sends rank 0 its rows of each member),
``full_tensor`` (`DTensor.full_tensor()` per member: an all-gather, the full tensor on every rank), and
``state_dict`` (`get_model_state_dict(full_state_dict=True, cpu_offload=True)`, then the fragment's
names: the whole model gathered onto rank 0's host). ``load`` times `ddiloco.learner.fsdp.load_full` of
the same fragment. The model is built on the meta device, sharded, then materialised shard by shard, so
the baseline resident memory is one rank's shard. Per method and rank: seconds and the growth of the
peak resident set (``ru_maxrss``) in MiB. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/fsdp_gather.py --layers 8 --width 512 --vocab 16384
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddiloco.learner.fsdp import full_tensors, load_full, shard_model
from ddiloco.model.gpt import GPT, GPTConfig, count_params
from ddiloco.platform.ports import free_port
from ddiloco.run.globalmodel import make_layout

WORLD = 2
METHODS = ("rows", "full_tensor", "state_dict", "load")


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _slice(t: torch.Tensor, name: str) -> torch.Tensor:
    if name.endswith("]"):
        a, b = name[name.rindex("[") + 1 : -1].split(":")
        return t[int(a) : int(b)].clone()
    return t


def _rank(rank: int, port: int, method: str, cfg: dict, fragments: int, fragment: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    with torch.device("meta"):
        model = GPT(GPTConfig(**cfg))
    names = make_layout(model, fragments).fragments[fragment].names
    shard_model(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    dist.barrier()
    before, t0 = _maxrss_mib(), time.perf_counter()
    if method == "rows":
        got = full_tensors(model, names)
    elif method == "full_tensor":
        params = dict(model.named_parameters())
        got = {}
        for n in names:
            base = n[: n.rindex("[")] if n.endswith("]") else n
            full = params[base].full_tensor()
            if rank == 0:
                got[n] = _slice(full, n)
            del full
    elif method == "state_dict":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        got = {n: _slice(sd[n[: n.rindex("[")] if n.endswith("]") else n], n) for n in names} if sd else {}
        del sd
    else:
        values = None
        if rank == 0:
            values = full_tensors(model, names)
            before, t0 = _maxrss_mib(), time.perf_counter()
        else:
            full_tensors(model, names)
        load_full(model, values)
        got = values
    dist.barrier()
    seconds = time.perf_counter() - t0
    nbytes = sum(v.numel() * v.element_size() for v in (got or {}).values())
    row = {"seconds": round(seconds, 4), "peak_rss_growth_mib": round(_maxrss_mib() - before, 1)}
    Path(f"{out}/{method}.{rank}.json").write_text(json.dumps({**row, "fragment_mib": nbytes / 2**20}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--fragment", type=int, default=0)
    ap.add_argument("--out", default="/tmp/fsdp_gather")
    args = ap.parse_args()
    cfg = dict(vocab_size=args.vocab, block_size=64, n_layer=args.layers, n_head=8, n_embd=args.width)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model_mib = count_params(GPTConfig(**cfg)) * 4 / 2**20
    result: dict = {"model_mib": round(model_mib, 1), "world": WORLD}
    for method in METHODS:
        a = (free_port(), method, cfg, args.fragments, args.fragment, args.out)
        mp.start_processes(_rank, args=a, nprocs=WORLD, start_method="spawn")
        rows = [json.loads(Path(f"{args.out}/{method}.{r}.json").read_text()) for r in range(WORLD)]
        result["fragment_mib"] = round(rows[0]["fragment_mib"], 1)
        result[method] = [{k: v for k, v in r.items() if k != "fragment_mib"} for r in rows]
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
