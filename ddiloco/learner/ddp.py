"""Data parallelism inside one learner: `torchrun`-style ranks on the GPUs of a pod, only rank 0 on the store.

Launched like any torch job (`torchrun --nproc-per-node=N -m ddiloco.cli.main learner ...`): `from_env`
reads the torchrun variables and returns None for a single process. Rank 0 is a full `Learner`; every other
rank is a `Follower`, which never touches the store. DDP's all-reduces and the parameter broadcasts go over
the default process group, rank 0's control messages (STEP, CURSOR, STOP) over a gloo group on the hosts.
After a hand-shake (config, layout, each follower's slice of the shard) rank 0 broadcasts its state, and
from then on every fragment it overwrites, so all ranks stay identical and every learner-side rule is
applied once, on rank 0. `train.parallel: fsdp` shards the model instead (`ddiloco.learner.sharded`). A
rank that dies takes the others down, and the learner restarts as a whole from its checkpoint.

Design notes: docs/internals.md, "Ranks inside a learner: DDP".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddiloco.config.run import RunConfig, TrainConfig
from ddiloco.data.loader import ShardLoader
from ddiloco.data.streamed import open_loader
from ddiloco.errors import ConfigError
from ddiloco.learner import sharded
from ddiloco.learner.accel import (
    maybe_compile,
    place_optimizer_steps,
    resolve_precision,
    to_device,
    train_step,
)
from ddiloco.model.gpt import configure_optimizer
from ddiloco.platform.devices import resolve_device
from ddiloco.run.globalmodel import Layout, build_model
from ddiloco.run.schedule import inner_lr, learner_train, progress_of

log = logging.getLogger(__name__)

STEP, CURSOR, STOP, HELLO, APPLY = 1, 2, 3, 4, 10
CONTROL_TIMEOUT_S = 6 * 3600
"""Followers wait on rank 0 this long (its start-up may wait for global version 0); a dead rank 0 ends
the job sooner through torchrun."""
_TOKEN_DTYPES = {"torch.int32": torch.int32, "torch.int64": torch.int64}


def rank_seed(learner_seed: int, rank: int) -> int:
    """Data seed of a rank: rank 0 keeps the learner's seed, so a one-rank learner reads what it always read."""
    return learner_seed if rank == 0 else learner_seed * 1000 + rank


def slice_bounds(num_tokens: int, world_size: int) -> list[int]:
    """Boundaries of the WORLD_SIZE contiguous slices of a shard: slice r is [b[r], b[r+1])."""
    return [num_tokens * r // world_size for r in range(world_size + 1)]


def from_env(device: str = "auto") -> Group | None:
    """Join the job torchrun started (None when WORLD_SIZE ≤ 1); NCCL on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if local >= torch.cuda.device_count():  # NCCL would fail on two ranks of one GPU, and say less
            raise ConfigError(
                f"learner rank {rank} is local rank {local} but this host shows {torch.cuda.device_count()} "
                "GPU(s): NCCL takes one GPU per rank; lower train.ranks or set train.device=cpu (gloo)"
            )
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))
    log.info("rank %d of %d joined (local rank %d, %s)", rank, world, local, "nccl" if cuda else "gloo")
    return Group(rank, world, resolve_device("cuda" if cuda else "cpu"), control)


class Group:
    """One learner's ranks: the control messages and broadcasts both sides run (see module docstring)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, control: Any) -> None:
        self.rank, self.world_size, self.device, self.control = rank, world_size, device, control
        self.stopped = False
        self.sharded, self.checkpointing, self.shard_precision = False, False, "fp32"

    def configure(self, t: TrainConfig) -> str:
        """Take the run's `train.parallel`; returns the autocast precision of the inner step (sharded: FSDP's
        mixed-precision policy casts instead, so fp32)."""
        precision = resolve_precision(t.precision, self.device)
        self.sharded = t.parallel == "fsdp"
        self.checkpointing = t.activation_checkpointing
        self.shard_precision = "bf16" if precision == "bf16" else "fp32"
        return "fp32" if self.sharded else precision

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP around the model (parameters synchronised at start, `lead_start`), or the model sharded in place
        (FSDP2, `ddiloco.learner.fsdp.shard_model`; build the optimizer afterwards)."""
        if self.sharded:
            from ddiloco.learner.fsdp import shard_model

            return shard_model(
                model, mixed_precision=self.shard_precision, checkpoint_activations=self.checkpointing
            )
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, init_sync=False)  # GPT has no buffers

    # --- control plane (gloo, host tensors) --------------------------------------------------------------
    def _bcast(self, t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, 0, group=self.control)
        return t

    def _bcast_bytes(self, blob: bytes | None) -> bytes:
        n = self._bcast(torch.tensor([len(blob) if blob is not None else 0], dtype=torch.int64))
        buf = (
            torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            if blob is not None
            else torch.empty(int(n), dtype=torch.uint8)
        )
        return bytes(self._bcast(buf).numpy())

    def _send_control(self, kind: int, step: int = 0, items: Sequence[int] = (), merged: int = 0) -> None:
        self._bcast(torch.tensor([kind, step, len(items), merged], dtype=torch.int64))
        if items:
            self._bcast(torch.tensor(list(items), dtype=torch.int64))

    def recv_control(self) -> tuple[int, int, list[int], int]:
        """(kind, inner step, fragment ids, tokens merged) of rank 0's next control message."""
        kind, step, n, merged = self._bcast(torch.zeros(4, dtype=torch.int64)).tolist()
        items = self._bcast(torch.zeros(n, dtype=torch.int64)).tolist() if n else []
        return kind, step, items, merged

    # --- hand-shake ----------------------------------------------------------------------------------------
    def lead_handshake(
        self,
        cfg: RunConfig,
        layout: Layout,
        learner_id: int,
        tokens: torch.Tensor | None,
        corpus: dict[str, Any] | None = None,
        slot: int = 0,
    ) -> torch.Tensor | None:
        """Send the run to the followers with their slices of the shard (returns rank 0's own slice), or, on
        a streamed corpus, the corpus document and the slot whose chunks the ranks share (returns None)."""
        self._send_control(HELLO)
        head = {"config": cfg.to_dict(), "layout": layout.to_json(), "learner_id": learner_id}
        if tokens is None:
            self._bcast_bytes(json.dumps({**head, "corpus": corpus, "slot": slot}).encode())
            return None
        self._bcast_bytes(json.dumps({**head, "dtype": str(tokens.dtype)}).encode())
        b = slice_bounds(tokens.numel(), self.world_size)
        for r in range(1, self.world_size):
            dist.send(torch.tensor([b[r + 1] - b[r]], dtype=torch.int64), dst=r, group=self.control)
            dist.send(tokens[b[r] : b[r + 1]].contiguous(), dst=r, group=self.control)
        return tokens[b[0] : b[1]]

    def follower_handshake(self) -> tuple[RunConfig, Layout, int, torch.Tensor | dict[str, Any]]:
        """(config, layout, learner id, this rank's slice of the shard or the streamed corpus's
        {"corpus", "slot"})."""
        head = json.loads(self._bcast_bytes(None))
        cfg, layout = RunConfig.from_dict(head["config"]), Layout.from_json(head["layout"])
        if "corpus" in head:
            return cfg, layout, int(head["learner_id"]), {"corpus": head["corpus"], "slot": head["slot"]}
        n = torch.zeros(1, dtype=torch.int64)
        dist.recv(n, src=0, group=self.control)
        tokens = torch.empty(int(n), dtype=_TOKEN_DTYPES[head["dtype"]])
        dist.recv(tokens, src=0, group=self.control)
        return cfg, layout, int(head["learner_id"]), tokens

    # --- start: parameters, AdamW state, inner step, data cursors ---------------------------------------
    def lead_start(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        inner_step: int,
        cursors: list[dict] | None,
    ) -> None:
        mine = [c if isinstance(c, dict) else None for c in (cursors or [])][: self.world_size]
        if self.sharded:  # parameters and AdamW state are already in the shards (`ddiloco.learner.sharded`)
            self._send_control(sharded.START, inner_step)
            self._bcast_bytes(json.dumps(mine).encode())
            return
        params = list(model.parameters())
        has = [p in opt.state and "exp_avg" in opt.state[p] for p in params]
        self._bcast(torch.tensor([inner_step, *has], dtype=torch.int64))
        steps = [float(opt.state[p]["step"]) if h else 0.0 for p, h in zip(params, has, strict=True)]
        self._bcast(torch.tensor(steps, dtype=torch.float64))
        self._bcast_bytes(json.dumps(mine).encode())  # each rank's data cursor from the checkpoint, or null
        self._bcast_state(params, opt, has)

    def follower_start(self, model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Any) -> int:
        """DDP's start (sharded ranks start on rank 0's START message instead: `Follower.run`)."""
        params = list(model.parameters())
        head = self._bcast(torch.zeros(1 + len(params), dtype=torch.int64)).tolist()
        inner_step, has = head[0], [bool(h) for h in head[1:]]
        steps = self._bcast(torch.zeros(len(params), dtype=torch.float64)).tolist()
        self._restore_cursor(loader, json.loads(self._bcast_bytes(None)))
        fused = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
        for p, h, s in zip(params, has, steps, strict=True):
            if h:
                opt.state[p] = {
                    "step": torch.tensor(s, dtype=torch.float32, device=p.device if fused else "cpu"),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        self._bcast_state(params, opt, has)
        return int(inner_step)

    def _restore_cursor(self, loader: Any, cursors: list[dict | None]) -> None:
        cursor = cursors[self.rank] if self.rank < len(cursors) else None
        if cursor is not None:
            try:
                loader.load_state_dict({"seed": loader.seed, **cursor})
            except ValueError as e:
                log.warning("rank %d: data cursor not restored (%s); reading afresh", self.rank, e)

    def _bcast_state(self, params: list[torch.Tensor], opt: torch.optim.Optimizer, has: list[bool]) -> None:
        with torch.no_grad():
            for p, h in zip(params, has, strict=True):
                dist.broadcast(p.data, 0)
                if h:
                    dist.broadcast(opt.state[p]["exp_avg"], 0)
                    dist.broadcast(opt.state[p]["exp_avg_sq"], 0)
        place_optimizer_steps(opt)

    # --- every step ----------------------------------------------------------------------------------------
    def lead_step(
        self, inner_step: int, applied: Sequence[int], layout: Layout, params: dict, merged: int = 0
    ) -> None:
        """Before rank 0's step: tell the followers to step (at the tokens merged rank 0 steps at, so every
        rank computes its learning rate), and broadcast the fragments it overwrote (sharded: already sent)."""
        applied = [] if self.sharded else sorted(set(applied))
        self._send_control(STEP, inner_step, applied, merged)
        self.broadcast_fragments(sorted(set(applied)), layout, params)

    def lead_apply(self, applied: Sequence[int], layout: Layout, params: dict) -> None:
        """Without a step (the run is closing): broadcast the fragments rank 0 overwrote (sharded: already
        sent), so every rank holds the merged versions."""
        applied = [] if self.sharded else sorted(set(applied))
        if applied:
            self._send_control(APPLY, 0, applied)
            self.broadcast_fragments(applied, layout, params)

    def broadcast_fragments(self, fragments: Sequence[int], layout: Layout, params: dict) -> None:
        with torch.no_grad():
            for p in fragments:
                for name in layout.fragments[p].names:
                    dist.broadcast(params[name].data, 0)

    def gather_cursors(self, own: dict) -> list[dict]:
        """Rank 0: every rank's data cursor (for a checkpoint); followers answer in `Follower.run`."""
        self._send_control(CURSOR)
        return [json.loads(b) for b in self._gather_bytes(json.dumps(own).encode())]

    def send_cursor(self, loader: Any) -> None:
        self._gather_bytes(json.dumps(loader.state_dict()).encode())

    def _gather_bytes(self, blob: bytes) -> list[bytes]:
        """Every rank's bytes on rank 0 (lengths first, then padded to the longest): JSON, never pickle."""
        n = torch.tensor([len(blob)], dtype=torch.int64)
        lengths = (
            [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)] if self.rank == 0 else None
        )
        dist.gather(n, lengths, dst=0, group=self.control)
        longest = self._bcast(
            torch.tensor([max(int(x) for x in lengths) if lengths else 0], dtype=torch.int64)
        )
        buf = torch.zeros(int(longest), dtype=torch.uint8)
        buf[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else buf[:0]
        got = [torch.zeros_like(buf) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(buf, got, dst=0, group=self.control)
        if got is None or lengths is None:
            return []
        return [bytes(g[: int(k)].numpy()) for g, k in zip(got, lengths, strict=True)]

    def stop(self) -> None:
        """Rank 0: end the followers (idempotent)."""
        if self.rank == 0 and not self.stopped:
            self._send_control(STOP)
        self.stopped = True

    def close(self) -> None:
        self.stop()
        dist.destroy_process_group()


def lead_handshake_loader(
    group: Group,
    cfg: RunConfig,
    layout: Layout,
    learner_id: int,
    loader: Any,
    corpus: dict[str, Any] | None,
    slot: int,
) -> Any:
    """Rank 0's hand-shake; returns its own loader: over its slice of the shard, or over its share of the
    streamed corpus's slot (`ddiloco.data.streamed.open_loader` with part (0, ranks))."""
    shape = {"batch_size": loader.batch_size, "seq_len": loader.seq_len, "seed": loader.seed}
    if isinstance(loader, ShardLoader):
        return ShardLoader(group.lead_handshake(cfg, layout, learner_id, loader.tokens), **shape)
    group.lead_handshake(cfg, layout, learner_id, None, corpus, slot)
    loader.close()
    return open_loader(corpus, slot, **shape, part=(0, group.world_size))


class Follower:
    """A rank > 0: the same inner steps on its slice of the shard, in lockstep with rank 0 through DDP."""

    def __init__(self, group: Group) -> None:
        self.group, self.steps = group, 0
        kind, _, _, _ = group.recv_control()
        self.stopped = kind == STOP  # rank 0 ended before handing over the run (e.g. the run was done)
        if self.stopped:
            return
        self.cfg, self.layout, self.learner_id, tokens = group.follower_handshake()
        t, dev = self.cfg.train, group.device
        if dev.type == "cpu":
            torch.set_num_threads(t.threads)
        self.model = build_model(self.layout, self.cfg.seed, device=dev)
        self.precision = group.configure(t)
        self.net = maybe_compile(group.wrap(self.model), t.compile)  # FSDP shards in place: optimizer after
        self.opt = configure_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))
        shape = {
            "batch_size": t.batch_for(self.learner_id),
            "seq_len": self.cfg.model.seq_len,
            "seed": rank_seed(self.cfg.seed * 1000 + self.learner_id, group.rank),
        }
        if isinstance(tokens, dict):  # a streamed corpus: this rank's share of the slot's chunks
            part = (group.rank, group.world_size)
            self.loader = open_loader(tokens["corpus"], tokens["slot"], **shape, part=part)
        else:
            self.loader = ShardLoader(tokens, **shape)
        named = dict(self.model.named_parameters())
        self.schedule = learner_train(self.cfg)  # the rate rank 0 steps at (`ddiloco.run.schedule.resolve`)
        self.params = {} if group.sharded else self.layout.members(named)  # by fragment member (DDP)

    def run(self) -> int:
        """Follow rank 0 until STOP; returns the exit code (0)."""
        if self.stopped:
            return 0
        t, dev = self.cfg.train, self.group.device
        if not self.group.sharded:  # sharded: rank 0 fills the shards first, then sends START
            self.group.follower_start(self.model, self.opt, self.loader)
        log.info("rank %d follows learner %d", self.group.rank, self.learner_id)
        while True:
            kind, inner_step, applied, merged = self.group.recv_control()
            if kind == STOP:
                log.info("rank %d stops after %d steps", self.group.rank, self.steps)
                return 0
            if kind == CURSOR:
                self.group.send_cursor(self.loader)
                continue
            if kind == APPLY:  # versions rank 0 applied while the run closes: no step
                self.group.broadcast_fragments(applied, self.layout, self.params)
                continue
            if kind == sharded.START:
                self.group._restore_cursor(self.loader, json.loads(self.group._bcast_bytes(None)))
                continue
            if kind in sharded.KINDS:  # rank 0 reads or writes whole fragments or the AdamW state
                sharded.serve(self.group, kind, self.model, self.opt)
                continue
            self.group.broadcast_fragments(applied, self.layout, self.params)
            x, y = self.loader.next_batch()
            lr = inner_lr(progress_of(merged, self.cfg.diloco.token_budget), inner_step, self.schedule)
            train_step(
                self.net,
                self.opt,
                to_device(x, dev),
                to_device(y, dev),
                lr,
                t.grad_clip,
                precision=self.precision,
            )
            self.steps += 1
