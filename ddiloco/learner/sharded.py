"""A learner's fragments and AdamW state when its ranks shard the model (FSDP2, `train.parallel: fsdp`).

Rank 0 runs the ordinary `Learner` and reaches the parameters through a members object: `LiveMembers` (one
process, or DDP) reads and writes the tensors in place, `ShardedMembers` gathers a fragment's rows to rank
0 (`ddiloco.learner.fsdp.full_tensors`) and sends them back (`load_full`), announcing each collective to
the followers on the control plane (GATHER, LOAD). Rank 0 keeps the anchors and gathered values on the
host, so a sharded learner needs no GPU memory for a full copy of the model. Checkpoints keep the
single-process format (rank 0 gathers the AdamW moments member by member: OPT_SAVE, OPT_LOAD), so a learner
may come back with another number of ranks, or as DDP.

Design notes: docs/internals.md, "Ranks inside a learner: FSDP2".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ddiloco.learner.accel import place_optimizer_steps
from ddiloco.learner.fsdp import full_tensors, load_full

log = logging.getLogger(__name__)

GATHER, LOAD, OPT_SAVE, OPT_LOAD, START = 5, 6, 7, 8, 9
"""Control messages of a sharded learner (after `ddiloco.learner.ddp`'s STEP, CURSOR, STOP, HELLO); START
carries the data cursors once the shards hold the globals and the checkpoint's state."""
KINDS = (GATHER, LOAD, OPT_SAVE, OPT_LOAD)
MOMENTS = ("exp_avg", "exp_avg_sq")

Tensors = dict[str, torch.Tensor]


class LiveMembers:
    """Fragment members as live views of the parameters (one process, or DDP: every rank holds them)."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self.params = params

    def read(self, names: Iterable[str]) -> Tensors:
        return {n: self.params[n].detach() for n in names}

    def write(self, values: Mapping[str, torch.Tensor], mixing: float) -> None:
        """values → members (α·local + (1 − α)·value when `mixing` α > 0); the values on the params' device."""
        with torch.no_grad():
            for name, g in values.items():
                if mixing > 0:
                    self.params[name].mul_(mixing).add_(g, alpha=1 - mixing)
                else:
                    self.params[name].copy_(g)


class ShardedMembers:
    """Rank 0's access to the members of a sharded model: whole values gathered to, and sent from, the host."""

    def __init__(self, group: Any, model: nn.Module, host: torch.device) -> None:
        self.group, self.model, self.device = group, model, host

    def read(self, names: Iterable[str]) -> Tensors:
        names = list(names)
        self.group._send_control(GATHER)
        self.group._bcast_bytes(json.dumps(names).encode())
        return full_tensors(self.model, names, out_device=self.device) or {}

    def write(self, values: Mapping[str, torch.Tensor], mixing: float) -> None:
        if mixing > 0:
            now = self.read(list(values))
            values = {n: now[n].mul_(mixing).add_(v.to(now[n]), alpha=1 - mixing) for n, v in values.items()}
        self.group._send_control(LOAD)
        load_full(self.model, values)


# --- AdamW state: gathered for a checkpoint, scattered at a restart -------------------------------------------
def save_optimizer(group: Any, model: nn.Module, opt: torch.optim.Optimizer) -> Tensors:
    """Rank 0: every rank's AdamW state as whole `opt/{param}/{field}` tensors on rank 0's host."""
    group._send_control(OPT_SAVE)
    return _gather_optimizer(model, opt)


def _gather_optimizer(model: nn.Module, opt: torch.optim.Optimizer) -> Tensors:
    sharded: Tensors = {}
    out: Tensors = {}
    for name, p in model.named_parameters():
        for field, value in opt.state.get(p, {}).items():
            if isinstance(value, DTensor):
                sharded[f"opt/{name}/{field}"] = value
            elif torch.is_tensor(value):  # the step counter: the same on every rank
                out[f"opt/{name}/{field}"] = value.detach().float().cpu()
    full = full_tensors(model, sorted(sharded), tensors=sharded, out_device="cpu")
    return {**out, **(full or {})}


def load_optimizer(group: Any, model: nn.Module, opt: torch.optim.Optimizer, tensors: Tensors | None) -> None:
    """Rank 0: the AdamW state of a checkpoint (`opt/{param}/{field}`, whole tensors) into every rank's
    shards; None: none (every rank keeps fresh state). Parameters with incomplete state are skipped."""
    params = dict(model.named_parameters())
    steps: dict[str, float] = {}
    for name, p in params.items():
        keys = [f"opt/{name}/{f}" for f in (*MOMENTS, "step")]
        if tensors is not None and all(k in tensors for k in keys):
            if any(tuple(tensors[k].shape) != tuple(p.shape) for k in keys[:2]):
                raise ValueError(f"checkpoint moments of {name} do not have its shape {tuple(p.shape)}")
            steps[name] = float(tensors[keys[2]])
    group._send_control(OPT_LOAD)
    group._bcast_bytes(json.dumps(steps).encode())
    _scatter_optimizer(model, opt, steps, tensors)


def _scatter_optimizer(
    model: nn.Module, opt: torch.optim.Optimizer, steps: Mapping[str, float], tensors: Tensors | None
) -> None:
    params = dict(model.named_parameters())
    targets: Tensors = {}
    for name, step in steps.items():
        p = params[name]
        opt.state[p] = {"step": torch.tensor(step, dtype=torch.float32)}
        for field in MOMENTS:
            opt.state[p][field] = targets[f"opt/{name}/{field}"] = torch.zeros_like(p)
    values = None if tensors is None else {k: tensors[k] for k in targets}
    if targets:
        load_full(model, values, targets=targets)
    place_optimizer_steps(opt)


def serve(group: Any, kind: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """A follower's side of one of rank 0's sharded-state requests (`KINDS`)."""
    if kind == GATHER:
        full_tensors(model, json.loads(group._bcast_bytes(None)))
    elif kind == LOAD:
        load_full(model, None)
    elif kind == OPT_SAVE:
        _gather_optimizer(model, opt)
    elif kind == OPT_LOAD:
        _scatter_optimizer(model, opt, json.loads(group._bcast_bytes(None)), None)
    else:
        raise ValueError(f"unknown control message {kind}")
