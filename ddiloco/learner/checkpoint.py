"""Learner checkpoints: what a rejoin needs (AdamW state, inner step, data cursor) as one safetensors payload.

No parameters: a (re)started learner overwrites every fragment with the current globals before its first
step, so stored parameters would never be read (a `1b` checkpoint is ~8 GB instead of ~13 GB). A checkpoint
that holds `param/...` tensors still loads; those tensors are ignored. The optimizer state is tensors named
`opt/{param}/{field}`, the scalars live in the JSON header; never pickle. A checkpoint is write-once
(`ckpt/step-N`), named by a `latest.json` pointer written after it, and then every other checkpoint of the
learner is deleted, so a crash at any point leaves one loadable checkpoint. The cadence scales with the state
(`checkpoint_every_s`). Checkpoints are signed; one that fails verification is not loaded, and the learner
starts from the current globals with fresh optimizer state.

Design notes (the cadence's figures per preset): docs/internals.md, "Checkpoints".
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ddiloco import keys
from ddiloco.learner.accel import place_optimizer_steps
from ddiloco.protocol import wire
from ddiloco.run.root import RunRoot
from ddiloco.store.base import NotFound, ObjectTooLarge

log = logging.getLogger(__name__)

MAX_CKPT_BYTES = 64 << 30
"""Cap for a model whose size is unknown; `checkpoint_max_bytes` gives the bound for a given model."""
CHECKPOINT_WRITE_BYTES_S = 32 << 20
"""Checkpoint bytes per second and learner the default cadence aims at."""
MIN_CHECKPOINT_S, MAX_CHECKPOINT_S = 20.0, 600.0


def checkpoint_every_s(configured: float | None, num_params: int) -> float:
    """Seconds between checkpoints: `configured` (`train.checkpoint_every_s`) when set, else by the state's
    size: AdamW's two fp32 moments per parameter over CHECKPOINT_WRITE_BYTES_S, within [MIN, MAX]."""
    if configured is not None:
        return configured
    return min(max(8 * num_params / CHECKPOINT_WRITE_BYTES_S, MIN_CHECKPOINT_S), MAX_CHECKPOINT_S)


def checkpoint_max_bytes(model: torch.nn.Module) -> int:
    """Parameters plus up to three optimizer tensors per parameter, 8 bytes per value, plus header slack."""
    params = list(model.parameters())
    return 4 * 8 * sum(p.numel() for p in params) + (1 << 20) + 1024 * len(params)


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
    root: RunRoot,
    learner_id: int,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> str:
    """Write the AdamW state of `model` as learner `learner_id`'s checkpoint at `step` (`write_checkpoint`)."""
    return write_checkpoint(root, learner_id, step, optimizer_tensors(model, opt), meta)


def write_checkpoint(
    root: RunRoot,
    learner_id: int,
    step: int,
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
) -> str:
    """Payload (the `opt/...` tensors, signed with the run key), then the latest pointer, then delete the
    learner's other checkpoints; returns the new checkpoint's key."""
    store, ckpt = root.store, keys.ckpt_key(learner_id, step)
    header = {**meta, "kind": "learner_ckpt", "learner_id": learner_id, "inner_step": step}
    store.put(ckpt, root.signer.pack(tensors, header))
    store.put_json(keys.ckpt_latest_key(learner_id), {"key": ckpt, "inner_step": step})
    for old in store.list(keys.ckpt_prefix(learner_id)):
        if old not in (ckpt, keys.ckpt_latest_key(learner_id)):
            store.delete(old)
    log.debug("learner %d checkpoint at step %d -> %s", learner_id, step, ckpt)
    return ckpt


def load_learner_checkpoint(
    root: RunRoot,
    learner_id: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    group: Any = None,
) -> dict[str, Any] | None:
    """Restore the AdamW state in place (the parameters come from the globals; a sharded learner's `group`
    scatters it over the ranks); return the checkpoint's JSON header, or None if there is none (or it fails
    verification: logged, and the learner starts fresh)."""
    store = root.store
    pointer = store.get_json_or_none(keys.ckpt_latest_key(learner_id))
    if pointer is None:
        return None
    ckpt = pointer.get("key") if isinstance(pointer, dict) else None
    try:
        if not isinstance(ckpt, str) or not ckpt.startswith(keys.learner_prefix(learner_id)):
            raise wire.PayloadError("malformed", f"checkpoint pointer names {str(ckpt)[:80]!r}")
        blob = store.get(ckpt, max_bytes=checkpoint_max_bytes(model))
        payload = root.signer.unpack(blob, {"kind": "learner_ckpt", "learner_id": learner_id})
    except NotFound:
        log.warning(
            "learner %d: checkpoint pointer names a missing object %s; starting fresh", learner_id, ckpt
        )
        return None
    except (wire.PayloadError, ObjectTooLarge, ValueError) as e:
        log.error("learner %d: checkpoint %s rejected (%s); starting fresh", learner_id, ckpt, e)
        return None
    if group is not None and group.sharded:
        from ddiloco.learner.sharded import load_optimizer

        load_optimizer(group, model, opt, payload.tensors)
    else:
        load_optimizer_tensors(model, opt, payload.tensors)
    return payload.meta


def restore_learner(
    root: RunRoot,
    learner_id: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loader: Any,
    *,
    group: Any = None,
) -> dict[str, Any] | None:
    """A learner's own newest checkpoint into `model`, `opt` (AdamW state, its steps placed on the device)
    and `loader` (data cursor); returns it (None when there is none). Parameters come from the globals."""
    ckpt = load_learner_checkpoint(root, learner_id, model, opt, group=group)
    if ckpt is None:
        return None
    place_optimizer_steps(opt)
    try:
        loader.load_state_dict(ckpt["cursor"])
    except ValueError as e:  # another number of ranks cut the shard differently
        log.warning("learner %d: data cursor not restored (%s); reading afresh", learner_id, e)
    log.info("learner %d: restored checkpoint at inner step %d", learner_id, int(ckpt["inner_step"]))
    return ckpt
