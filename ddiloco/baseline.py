"""`ddiloco baseline`: synchronous data-parallel training of the same model, on the same data, for comparison.

Same everything as a DiLoCo run of the same prepared store (rank r reads learner r's shard with the learner's
data seed, starts from global version 0, and steps with the learner's own `train_step`, precision and
schedule); the only difference is that gradients are averaged over the M ranks before clipping, every step.
The M ranks are real processes over `torch.distributed` (gloo on CPU, NCCL on GPU, loopback rendezvous), and
one DDP communication hook counts the bytes all-reduced; `bytes_sent` is a ring all-reduce's, the figure
compared with a learner's uploads. Training stops after ⌈tokens / (M·B·T)⌉ steps; reports and the final model
go to `baseline/` and the parent writes `baseline/summary.json`.

Design notes: docs/internals.md, "The data-parallel baseline"; how it is used: docs/development.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.data.loader import ShardLoader
from ddiloco.data.shards import assign_shard
from ddiloco.data.streamed import open_loader, read_corpus_doc
from ddiloco.errors import ConfigError
from ddiloco.learner.accel import resolve_precision, train_step
from ddiloco.model.gpt import GPT, configure_optimizer
from ddiloco.platform.devices import resolve_device
from ddiloco.platform.ports import free_port
from ddiloco.posttrain.evaluate import run_validation_loss
from ddiloco.protocol import wire
from ddiloco.run.globalmodel import MAX_FRAGMENT_BYTES, Layout, build_model, read_layout
from ddiloco.run.root import RunRoot
from ddiloco.run.schedule import inner_lr, progress_of
from ddiloco.store.base import Store
from ddiloco.store.shaped import Link
from ddiloco.store.url import open_store

log = logging.getLogger(__name__)

HISTORY_POINTS = 200


def ring_factor(world_size: int) -> float:
    """Bytes a ring all-reduce sends per rank, as a multiple of the payload: 2(M−1)/M."""
    return 2 * (world_size - 1) / world_size


@dataclass(slots=True)
class Plan:
    """What every rank needs; built once by the parent, sent to the workers."""

    url: str
    world_size: int
    steps: int
    token_budget: int
    """Tokens the run trains for (the schedule's progress is tokens processed / token_budget)."""
    backend: str
    device: str
    master_port: int
    threads: int
    log_level: int


class ByteCounter:
    """DDP communication hook state: payload bytes and calls, then the stock averaging all-reduce."""

    def __init__(self, link: Link | None = None, world_size: int = 1) -> None:
        self.bytes = 0
        self.calls = 0
        self.link, self.world_size = link, world_size
        self.link_seconds = 0.0


def counting_allreduce_hook(state, bucket):  # no annotations: DDP checks them against its own types
    """Count the bucket's payload bytes, then all-reduce and average it like DDP's default."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    buf = bucket.buffer()
    nbytes = buf.numel() * buf.element_size()
    state.bytes += nbytes
    state.calls += 1
    if (
        state.link is not None
    ):  # the run's `link` section: this ring all-reduce crosses it (ddiloco.store.shaped)
        delay = state.link.allreduce_seconds(nbytes, state.world_size)
        state.link_seconds += delay
        time.sleep(delay)
    return allreduce_hook(None, bucket)  # None = the default (world) process group; divides by M


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def load_initial_model(store: Store, cfg: RunConfig, layout: Layout) -> GPT:
    """The model learners start from: global version 0 of every fragment, as published by `prepare`."""
    model = build_model(layout, cfg.seed)
    params, root = layout.members(dict(model.named_parameters())), RunRoot(store, cfg.run_id)
    with torch.no_grad():
        for frag in layout.fragments:
            for name, t in root.read_global(layout, frag.fragment_id, 0).items():
                params[name].copy_(t)
    return model


def load_baseline_model(store: Store, run_id: str, layout: Layout) -> GPT:
    payload = wire.unpack(
        store.get(keys.BASELINE_MODEL, max_bytes=MAX_FRAGMENT_BYTES * 4),
        expect={"run_id": run_id, "kind": "baseline_final"},
    )
    model = build_model(layout)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = payload.tensors.get(name)
            if t is None or t.shape != p.shape:
                raise wire.PayloadError("wrong_shape", f"baseline model is missing or mis-shapes {name}")
            p.copy_(t.float())
    return model


def _sample(history: list[list[float]]) -> list[list[float]]:
    if len(history) <= HISTORY_POINTS:
        return history
    stride = math.ceil(len(history) / HISTORY_POINTS)
    return history[::stride] + ([history[-1]] if (len(history) - 1) % stride else [])


def _rank_main(rank: int, plan: Plan) -> None:
    """One data-parallel rank: set up, train `plan.steps` steps, write its report (and rank 0 the model)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    logging.basicConfig(level=plan.log_level, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan.master_port))
    if plan.backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only: never look for another interface
    store = open_store(plan.url)
    cfg = RunRoot.read_config(store)
    t = cfg.train
    if plan.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(plan.threads)
    dist.init_process_group(plan.backend, rank=rank, world_size=plan.world_size)
    try:
        layout = read_layout(store)
        meta = store.get_json(keys.DATA_META)
        shard = assign_shard(rank, meta["shard_tokens"], role="rank").shard
        shape = {"batch_size": t.batch_size, "seq_len": cfg.model.seq_len, "seed": cfg.seed * 1000 + rank}
        if meta.get("streamed"):  # a pre-tokenized corpus read in place
            loader = open_loader(read_corpus_doc(store), shard, **shape)
        else:
            loader = ShardLoader(RunRoot(store, cfg.run_id).shard(shard), **shape)
        model = load_initial_model(store, cfg, layout).to(device)
        precision = resolve_precision(t.precision, device)  # the learners' own: bf16 autocast on a GPU
        opt = configure_optimizer(model, t.lr, t.weight_decay, (t.beta1, t.beta2))
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            init_sync=False,
        )
        counter = ByteCounter(Link.from_config(cfg.link), plan.world_size)
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        history: list[list[float]] = []
        tokens, lr = 0, t.lr
        global_batch = plan.world_size * t.batch_size * cfg.model.seq_len
        dist.barrier()
        t0 = time.time()
        for step in range(plan.steps):
            x, y = loader.next_batch()
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            lr = inner_lr(progress_of(step * global_batch, plan.token_budget), step, t)
            loss = float(train_step(ddp, opt, x, y, lr, t.grad_clip, precision=precision))
            if not math.isfinite(loss):
                raise FloatingPointError(f"rank {rank}: loss is {loss} at step {step}; lower train.lr")
            tokens += x.numel()
            history.append([step, loss])
        dist.barrier()
        wall = time.time() - t0
        report = {
            "run_id": cfg.run_id,
            "rank": rank,
            "world_size": plan.world_size,
            "backend": plan.backend,
            "device": str(device),
            "precision": precision,
            "steps": plan.steps,
            "tokens_processed": tokens,
            "train_seconds": wall,
            "started_at": t0,
            "bytes_allreduced": counter.bytes,
            "allreduce_calls": counter.calls,
            "bytes_sent": counter.bytes * ring_factor(plan.world_size),
            "params_sha256": params_sha256(model),
            "link_seconds": counter.link_seconds,
            "last_lr": lr,
            "first_loss": history[0][1] if history else None,
            "last_loss": sum(h[1] for h in history[-20:]) / len(history[-20:]) if history else None,
            "history": _sample(history),
        }
        if rank == 0:
            store.put(
                keys.BASELINE_MODEL,
                wire.pack(dict(model.named_parameters()), {"run_id": cfg.run_id, "kind": "baseline_final"}),
            )
        store.put_json(keys.baseline_rank_key(rank), report)
    finally:
        dist.destroy_process_group()


def run_baseline(
    url: str,
    *,
    learners: int | None = None,
    tokens: int | None = None,
    device: str | None = None,
    timeout: float | None = None,
    tasks: bool = True,
) -> dict[str, Any]:
    """Train data-parallel with M ranks on the prepared run root at `url`; returns (and stores) the summary.

    learners: M (default diloco.learners); tokens: total tokens to process (default diloco.token_budget);
    tasks: also score the downstream tasks, as `ddiloco run` does for its final model (settings: cfg.eval).
    """
    if url.startswith("memory://"):
        raise ConfigError("ddiloco baseline runs M processes; use a file:// or s3:// store, not memory://")
    store = open_store(url)
    cfg = RunRoot.read_config(store)
    if store.get_json_or_none(keys.DATA_META) is None:
        raise ConfigError(f"{url} is not prepared; run `ddiloco prepare --store {url}` first (or --prepare)")
    M = learners or cfg.diloco.learners
    budget = tokens or cfg.diloco.token_budget
    if M < 1 or budget < 1:
        raise ConfigError(f"--learners ({M}) and --tokens ({budget}) must be ≥ 1")
    dev = resolve_device(device or cfg.train.device).type
    if dev == "cuda" and M > torch.cuda.device_count():
        raise ConfigError(
            f"NCCL needs one GPU per rank: {M} ranks but {torch.cuda.device_count()} GPUs; lower --learners"
        )
    global_batch_tokens = M * cfg.train.batch_size * cfg.model.seq_len
    plan = Plan(
        url=url,
        world_size=M,
        steps=math.ceil(budget / global_batch_tokens),
        token_budget=budget,
        backend="nccl" if dev == "cuda" else "gloo",
        device=dev,
        master_port=free_port(),
        threads=cfg.train.threads,
        log_level=log.getEffectiveLevel(),
    )
    for r in range(M):  # a rerun must not mistake an older report for this one's
        if store.exists(keys.baseline_rank_key(r)):
            store.delete(keys.baseline_rank_key(r))
    layout = read_layout(store)
    log.info(
        "baseline: %d %s ranks × batch %d × seq %d, %d steps (%d tokens)",
        M,
        plan.backend,
        cfg.train.batch_size,
        cfg.model.seq_len,
        plan.steps,
        plan.steps * global_batch_tokens,
    )
    started = time.time()
    _spawn(plan, timeout)
    elapsed = time.time() - started
    reports = [store.get_json(keys.baseline_rank_key(r)) for r in range(M)]
    val = RunRoot(store, cfg.run_id).val()

    def evaluate(model: GPT) -> float:
        return run_validation_loss(model, val, cfg)

    initial = evaluate(load_initial_model(store, cfg, layout))
    model = load_baseline_model(store, cfg.run_id, layout)
    final = evaluate(model)
    r0 = reports[0]
    summary = {
        "method": "data-parallel",
        "run_id": cfg.run_id,
        "status": "done",
        "learners": M,
        "backend": plan.backend,
        "device": r0["device"],
        "precision": r0["precision"],
        "batch_size": cfg.train.batch_size,
        "global_batch": M * cfg.train.batch_size,
        "seq_len": cfg.model.seq_len,
        "steps": plan.steps,
        "token_budget": budget,
        "tokens_processed": sum(r["tokens_processed"] for r in reports),
        "model_params": model.num_params(),
        "wall_seconds": max(r["train_seconds"] for r in reports),
        "elapsed_seconds": elapsed,
        "bytes_allreduced_per_rank": r0["bytes_allreduced"],
        "ring_factor": ring_factor(M),
        "bytes_sent_per_rank": r0["bytes_sent"],
        "bytes_uploaded": sum(r["bytes_sent"] for r in reports),
        "allreduce_calls_per_rank": r0["allreduce_calls"],
        "link": None if cfg.link is None else {"bandwidth": cfg.link.bandwidth, "latency": cfg.link.latency},
        "link_seconds_per_rank": r0["link_seconds"] if cfg.link is not None else None,
        "params_identical": len({r["params_sha256"] for r in reports}) == 1,
        "initial_val_loss": initial,
        "final_val_loss": final,
        "first_train_loss": r0["first_loss"],
        "last_train_loss": r0["last_loss"],
        "task_accuracy": None,
    }
    summary["tokens_per_second"] = summary["tokens_processed"] / summary["wall_seconds"]
    if tasks:
        from ddiloco.posttrain.evaluate import evaluate_checkpoint

        root = RunRoot(store, cfg.run_id)  # the baseline signs nothing: its model is read unsigned
        result = evaluate_checkpoint(root, keys.BASELINE_MODEL, name="baseline", ecfg=cfg.eval)
        summary["task_accuracy"] = result["task_accuracy"]
    store.put_json(keys.BASELINE_SUMMARY, summary)
    log.info(
        "baseline: done in %.0fs, val loss %.4f -> %.4f, %.1f MB sent per rank (ring)",
        elapsed,
        initial,
        final,
        summary["bytes_sent_per_rank"] / 1e6,
    )
    return summary


def _spawn(plan: Plan, timeout: float | None) -> None:
    """Start the M ranks and wait; a failing rank fails the run with its traceback."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _rank_main, args=(plan,), nprocs=plan.world_size, join=False, start_method="spawn"
    )
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"data-parallel baseline did not finish within {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
