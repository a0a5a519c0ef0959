"""Real rank processes for the DDP / FSDP tests: spawn-and-wait with a deadline that kills what is left."""

from __future__ import annotations

import time
from collections.abc import Callable


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float) -> None:
    """Run fn(rank, *args) in `nprocs` fresh processes; fail if they have not all ended by `timeout`. The
    processes are forked from a forkserver that imported torch and the learner once for the whole session
    (each spawned rank used to import them again, seconds per rank on a loaded machine); the server starts
    no threads and touches no accelerator, so each rank is as clean as a spawned one."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(
        ["torch", "ddiloco.learner.loop", "ddiloco.learner.fsdp", fn.__module__]
    )
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "the ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


def one_process_reference(store, cfg, world: int, steps: int):
    """The single-process reference of a learner with `world` ranks: global version 0, each step on every
    rank's batch concatenated (rank r reads slice r of shard 0). Returns (model, optimizer, rank loaders,
    parameters before the first step)."""
    import torch

    from ddiloco.data.loader import ShardLoader
    from ddiloco.learner import ddp
    from ddiloco.learner.accel import train_step
    from ddiloco.model.gpt import configure_optimizer, init_model
    from ddiloco.run.globalmodel import read_layout
    from ddiloco.run.root import RunRoot
    from ddiloco.run.schedule import lr_at

    t, B = cfg.train, cfg.train.batch_size
    layout = read_layout(store)
    ref = init_model(layout.gpt_config(), 0)
    with torch.no_grad():
        for p in range(layout.num_fragments):
            for n, v in RunRoot(store, cfg.run_id).read_global(layout, p, 0).items():
                dict(ref.named_parameters())[n].copy_(v)
    opt = configure_optimizer(ref, t.lr, t.weight_decay, (t.beta1, t.beta2))
    tokens = RunRoot(store, cfg.run_id).shard(0)
    b = ddp.slice_bounds(tokens.numel(), world)
    seq = cfg.model.seq_len
    loaders = [
        ShardLoader(
            tokens[b[r] : b[r + 1]], batch_size=B, seq_len=seq, seed=ddp.rank_seed(cfg.seed * 1000, r)
        )
        for r in range(world)
    ]
    start = {n: v.clone() for n, v in ref.named_parameters()}
    for step in range(steps):
        batches = [ld.next_batch() for ld in loaders]
        x, y = torch.cat([xb for xb, _ in batches]), torch.cat([yb for _, yb in batches])
        train_step(ref, opt, x, y, lr_at(step, t.lr, t.warmup_steps), t.grad_clip)
    return ref, opt, loaders, start
