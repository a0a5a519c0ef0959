"""FSDP2 inside one learner: the model sharded over the learner's ranks, and full fragments in and out of it.

`shard_model` applies `fully_shard` to every transformer block (found generically: the GPT's `Block`s, a
Hugging Face model's `_no_split_modules`, or classes ending in "DecoderLayer") and then to the root, keeps
parameter names unchanged (activation checkpointing without wrapper modules) and uses bf16 compute with fp32
master shards. Fragments move by rows, point to point, one member at a time: `full_tensors` gathers a
member's rows on rank 0 and `load_full` scatters rank 0's values back, so no rank ever holds more than its
shard plus one member (all-gathering every tensor, or the whole state dict, scales with the model:
`benchmarks/fsdp_gather.py`). Names travel as JSON, and only `Shard(0)` on a one-dimensional mesh is
accepted.

Design notes: docs/internals.md, "Ranks inside a learner: FSDP2".
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

PRECISIONS = ("fp32", "bf16")
_PIECE = re.compile(r"^(?P<tensor>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")
"""A layout piece's member name, `ddiloco.run.fragments.Piece.name`: rows [start, stop) of a parameter."""


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a GPT or a Hugging Face causal LM, in model order (outermost matches only)."""
    from ddiloco.model.gpt import Block

    split = {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or ())}

    def is_block(m: nn.Module) -> bool:
        name = type(m).__name__
        return isinstance(m, Block) or name in split or name.endswith("DecoderLayer")

    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():  # pre-order: an outer block comes before the modules inside it
        if id(m) in inside:
            continue
        if m is not model and is_block(m):
            found.append(m)
            inside.update(id(s) for s in m.modules())
    return found


def shard_model(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mixed_precision: str = "fp32",
    reshard_after_forward: bool = True,
    checkpoint_activations: bool = False,
) -> nn.Module:
    """Shard `model` in place over `mesh` (default: every rank of the default group) and return it.

    Build the optimizer afterwards, on the sharded parameters.
    """
    if mixed_precision not in PRECISIONS:
        raise ValueError(f"mixed_precision must be one of {PRECISIONS}, got {mixed_precision!r}")
    blocks = blocks_of(model)
    if not blocks:
        raise ValueError(f"no transformer blocks found in {type(model).__name__}; cannot shard it")
    mp = MixedPrecisionPolicy()
    if mixed_precision == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        if checkpoint_activations:
            block.forward = functools.partial(_checkpointed, block.forward)  # type: ignore[method-assign]
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root's parameters are used last in backward (the LM head): no point resharding them after forward.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


# --- rows of a member on each rank ------------------------------------------------------------------------
def _member(name: str) -> tuple[str, int | None, int | None]:
    m = _PIECE.match(name)
    return (name, None, None) if m is None else (m["tensor"], int(m["start"]), int(m["stop"]))


def _row_ranges(p: DTensor, world: int) -> list[tuple[int, int]]:
    """Rows [lo, hi) of the global tensor that each mesh rank holds (FSDP2's `Shard(0)`, `torch.chunk`)."""
    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"expected a Shard(0) parameter, got placements {p.placements}")
    rows = p.shape[0]
    c = math.ceil(rows / world)
    return [(min(r * c, rows), min((r + 1) * c, rows)) for r in range(world)]


def _plan(
    p: torch.Tensor, start: int | None, stop: int | None, world: int
) -> tuple[int, int, list[tuple[int, int]]]:
    """The member's rows [start, stop) of `p` and, per mesh rank, those of them it holds [lo, hi) (lo == hi:
    none)."""
    start, stop = (0, p.shape[0]) if start is None or stop is None else (start, stop)
    out = []
    for lo, hi in _row_ranges(p, world):  # type: ignore[arg-type]
        a, b = max(lo, start), min(hi, stop)
        out.append((a, max(a, b)))
    return start, stop, out


def _plan_of(
    params: Mapping[str, torch.Tensor], name: str, world: int
) -> tuple[DTensor, int, int, list[tuple[int, int]]]:
    """Member `name`'s sharded parameter (or tensor placed like it) and its `_plan`."""
    tensor, start, stop = _member(name)
    p = params[tensor]
    return (p, *_plan(p, start, stop, world))  # type: ignore[return-value]


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def _mesh_group(p: torch.Tensor) -> tuple[dist.ProcessGroup, int, int]:
    if not isinstance(p, DTensor):
        raise TypeError("the model is not sharded (call shard_model first)")
    group = p.device_mesh.get_group()
    return group, dist.get_rank(group), dist.get_world_size(group)


def full_tensors(
    model: nn.Module,
    names: Iterable[str],
    *,
    tensors: Mapping[str, torch.Tensor] | None = None,
    out_device: torch.device | str | None = None,
) -> dict[str, torch.Tensor] | None:
    """The full values of the named members (parameters, or layout pieces `name[start:stop]`) on mesh rank 0,
    None on the other ranks. A collective: every rank calls it with the same names, in the same order.
    The values are fresh tensors on the parameters' device (or moved to `out_device` one by one as they
    arrive, so rank 0's device holds one member at a time), in the parameters' dtype. `tensors`: sharded
    tensors to read by name instead of the model's parameters (e.g. AdamW moments, placed like their
    parameters)."""
    params = _params(model) if tensors is None else dict(tensors)
    group, rank, world = _mesh_group(next(iter(_params(model).values())))
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in names:
            p, base, end, plan = _plan_of(params, name, world)
            local = p.to_local()
            if rank == 0:
                full = torch.empty((end - base, *p.shape[1:]), dtype=p.dtype, device=local.device)
                for r, (lo, hi) in enumerate(plan):
                    if hi == lo:
                        continue
                    dst = full[lo - base : hi - base]
                    if r == 0:
                        dst.copy_(local[lo:hi])
                    else:
                        _recv_into(dst, group, r)
                out[name] = full if out_device is None else full.to(out_device)
            else:
                lo, hi = plan[rank]
                if hi > lo:
                    off = _row_ranges(p, world)[rank][0]  # type: ignore[arg-type]
                    dist.send(local[lo - off : hi - off].contiguous(), group=group, group_dst=0)
    return out if rank == 0 else None


def load_full(
    model: nn.Module,
    tensors: Mapping[str, torch.Tensor] | None,
    *,
    targets: Mapping[str, torch.Tensor] | None = None,
) -> list[str]:
    """Overwrite members with rank 0's full values: mesh rank 0 passes `tensors` (member name → full value,
    on any device), the other ranks None; every rank ends with its rows of each. A collective; returns the
    names loaded (rank 0's, in its order). `targets`: sharded tensors to write by name instead of the
    model's parameters (every rank passes the same names)."""
    params = _params(model) if targets is None else dict(targets)
    first = next(iter(_params(model).values()))
    group, rank, world = _mesh_group(first)
    if rank == 0:
        for name, value in (
            tensors or {}
        ).items():  # before any traffic: a bad value must not strand the others
            p, base, end, _ = _plan_of(params, name, world)
            if tuple(value.shape) != (end - base, *p.shape[1:]):
                raise ValueError(f"{name}: shape {tuple(value.shape)} does not fit its parameter")
    names = _bcast_names(list(tensors or {}) if rank == 0 else None, group, first.device)
    with torch.no_grad():
        for name in names:
            p, base, _, plan = _plan_of(params, name, world)
            local = p.to_local()
            off = _row_ranges(p, world)[rank][0]  # type: ignore[arg-type]
            if rank == 0:
                assert tensors is not None
                value = tensors[name].to(device=local.device, dtype=local.dtype)
                for r, (lo, hi) in enumerate(plan):
                    if hi == lo:
                        continue
                    if r == 0:
                        local[lo - off : hi - off].copy_(value[lo - base : hi - base])
                    else:
                        dist.send(value[lo - base : hi - base].contiguous(), group=group, group_dst=r)
            else:
                lo, hi = plan[rank]
                if hi > lo:
                    _recv_into(local[lo - off : hi - off], group, 0)
    return names


def _recv_into(dst: torch.Tensor, group: dist.ProcessGroup, src: int) -> None:
    """Receive straight into `dst` (rows of a contiguous tensor are contiguous), else through a buffer."""
    buf = dst if dst.is_contiguous() else torch.empty_like(dst, memory_format=torch.contiguous_format)
    dist.recv(buf, group=group, group_src=src)
    if buf is not dst:
        dst.copy_(buf)


def _bcast_names(names: Sequence[str] | None, group: dist.ProcessGroup, device: torch.device) -> list[str]:
    """Rank 0's list of names on every rank of `group` (JSON bytes; the group's backend, on its device)."""
    blob = json.dumps(list(names)).encode() if names is not None else b""
    n = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    dist.broadcast(n, group=group, group_src=0)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    if names is not None:
        buf.copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
    dist.broadcast(buf, group=group, group_src=0)
    return list(json.loads(bytes(buf.cpu().numpy())))


# --- memory -------------------------------------------------------------------------------------------------
def _local_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes_per_rank(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank keeps between steps: local parameter shards, their gradients and the optimizer state.

    Gradients are counted at their size during a step (one per trainable parameter, like its local shard),
    whether or not they are allocated right now (`zero_grad(set_to_none=True)` frees them). Works for an
    unsharded model too (whole tensors), which is what DDP keeps on every rank.
    """
    params = list(model.parameters())
    total = sum(_local_bytes(p) for p in params)
    total += sum(_local_bytes(p.grad if p.grad is not None else p) for p in params if p.requires_grad)
    if opt is not None:
        for state in opt.state.values():
            total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total
