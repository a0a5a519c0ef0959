"""Learner checkpoints: parameters, AdamW state and the data cursor as one safetensors payload.

Design choices:
- safetensors + JSON header only (never torch.load/pickle): the optimizer state is flattened to tensors named
  `opt/{param}/{field}` and the scalar bits (step counters, data cursor) live in the JSON header.
- A checkpoint is write-once (`ckpt/step-N`) and a small `latest.json` pointer names it; the pointer is
  written after the payload, and older payloads are deleted afterwards, so a crash at any point leaves a
  loadable checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ddiloco import wire
from ddiloco.store import NotFound, Store

log = logging.getLogger(__name__)

MAX_CKPT_BYTES = 64 << 30


def optimizer_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flatten AdamW state into name-addressed tensors (parameter names, not indices)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        for field, value in opt.state.get(p, {}).items():
            if torch.is_tensor(value):
                out[f"opt/{name}/{field}"] = value.detach().float() if value.dim() == 0 else value.detach()
    return out


def load_optimizer_tensors(
    model: torch.nn.Module, opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        if not key.startswith("opt/"):
            continue
        name, field = key[4:].rsplit("/", 1)
        if name not in params:
            raise ValueError(f"checkpoint has optimizer state for unknown parameter {name!r}")
        p = params[name]
        state = opt.state[p]
        if field == "step":
            state[field] = value.to(torch.float32).reshape(())
        else:
            if value.shape != p.shape:
                raise ValueError(
                    f"optimizer state {key} has shape {tuple(value.shape)}, parameter has {tuple(p.shape)}"
                )
            state[field] = value.to(device=p.device, dtype=p.dtype)


def save_learner_checkpoint(
    store: Store,
    learner_id: int,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> str:
    tensors = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    tensors.update(optimizer_tensors(model, opt))
    key = wire.ckpt_key(learner_id, step)
    store.put(
        key,
        wire.pack(tensors, {**meta, "kind": "learner_ckpt", "learner_id": learner_id, "inner_step": step}),
    )
    previous = store.get_json_or_none(wire.ckpt_latest_key(learner_id))
    store.put_json(wire.ckpt_latest_key(learner_id), {"key": key, "inner_step": step})
    if previous and previous.get("key") not in (None, key):
        store.delete(previous["key"])
    log.debug("learner %d checkpoint at step %d -> %s", learner_id, step, key)
    return key


def load_learner_checkpoint(
    store: Store, learner_id: int, run_id: str, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Restore params + AdamW state in place; return the checkpoint's JSON header, or None if there is none."""
    pointer = store.get_json_or_none(wire.ckpt_latest_key(learner_id))
    if pointer is None:
        return None
    try:
        blob = store.get(pointer["key"], max_bytes=MAX_CKPT_BYTES)
    except NotFound:
        log.warning(
            "learner %d: checkpoint pointer names a missing object %s; starting fresh",
            learner_id,
            pointer["key"],
        )
        return None
    payload = wire.unpack(blob, expect={"run_id": run_id, "kind": "learner_ckpt", "learner_id": learner_id})
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            t = payload.tensors.get(f"param/{name}")
            if t is None or t.shape != p.shape:
                raise ValueError(f"checkpoint {pointer['key']} does not match the model (parameter {name})")
            p.copy_(t)
    load_optimizer_tensors(model, opt, payload.tensors)
    return payload.meta
