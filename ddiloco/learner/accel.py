"""Where and how the inner step runs: device, precision, fused AdamW, torch.compile, host snapshots.

One inner step (`train_step`) is shared by the learner, its data-parallel ranks, the baseline and the
benchmarks, and never synchronises (it returns the loss as a device tensor). Precision is bf16 autocast
around the forward pass only (`precision="bf16"`, or `auto` on a CUDA device that supports it); everything
else stays fp32, and no global torch flag is changed, so fp32 runs match on CPU and GPU. AdamW is fused on
CUDA; `torch.compile` is opt-in (`train.compile`). `HostCopier` snapshots tensors to pinned host buffers on a
side CUDA stream, and the compute stream waits for a copy only before it next overwrites the tensor.

Design notes: docs/internals.md, "Devices, precision and host snapshots".
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}


def resolve_precision(precision: str, device: torch.device) -> str:
    """`fp32` or `bf16`: `auto` is bf16 on a CUDA device with bf16 support, fp32 elsewhere."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision not in _AUTOCAST:
        raise ValueError(f"precision={precision!r}: choose auto, fp32 or bf16")
    return precision


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward-pass context of a resolved precision (a no-op for fp32)."""
    dtype = _AUTOCAST[precision]
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    lr: float,
    grad_clip: float,
    *,
    precision: str = "fp32",
    before_update: Callable[[], None] | None = None,
) -> torch.Tensor:
    """One AdamW step; returns the detached loss without synchronising the device.

    `model` may be wrapped (DDP, compiled); `before_update` runs between backward and the optimizer step
    (the learner's fence for in-flight snapshots of the parameters).
    """
    for group in opt.param_groups:
        group["lr"] = lr
    with autocast(x.device, precision):
        _, loss = model(x, y)
    loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if before_update is not None:
        before_update()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def maybe_compile(model: torch.nn.Module, enabled: bool, **kwargs: Any) -> torch.nn.Module:
    """`torch.compile(model)` when enabled (parameters stay shared with `model`), else `model` itself."""
    if not enabled:
        return model
    log.info("compiling the model for the inner steps (the first steps are slow)")
    return torch.compile(model, **kwargs)  # type: ignore[return-value]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor → device; on CUDA through pinned memory, so the copy does not block the host."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pin(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Page-locked copies of host tensors bound for a CUDA `device` (run on an I/O thread), else the tensors."""
    if device.type != "cuda":
        return tensors
    return {n: t.pin_memory() for n, t in tensors.items()}


def place_optimizer_steps(opt: torch.optim.Optimizer) -> None:
    """Fused/capturable AdamW keeps `step` on the parameter's device; a restored one arrives on the host."""
    for group in opt.param_groups:
        if not (group.get("fused") or group.get("capturable")):
            continue
        for p in group["params"]:
            st = opt.state.get(p)
            step = st.get("step") if st else None
            if torch.is_tensor(step) and (step.device != p.device or step.dtype != torch.float32):
                st["step"] = step.to(device=p.device, dtype=torch.float32)


class HostSnapshot:
    """Host copies of named tensors; `wait()` before reading them, `release()` once done with them."""

    def __init__(
        self, tensors: dict[str, torch.Tensor], event: Any, copier: HostCopier | None = None
    ) -> None:
        self.tensors, self._event, self._copier = tensors, event, copier

    def wait(self) -> dict[str, torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self.tensors

    def release(self) -> None:
        """Return the pinned buffers for reuse; the tensors must not be read afterwards."""
        if self._copier is not None:
            self._copier.give_back(self.tensors.values())
            self._copier = None


class HostCopier:
    """Device→host snapshots that never stall the compute stream (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._fences: list[Any] = []
        self._lock = threading.Lock()

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(like.shape), like.dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                return free.pop()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def give_back(self, buffers: Any) -> None:
        with self._lock:
            for b in buffers:
                self._free.setdefault((tuple(b.shape), b.dtype), []).append(b)

    def snapshot(self, tensors: dict[str, torch.Tensor], copy: bool = True) -> HostSnapshot:
        """Copy `tensors` (as they are once the work queued so far is done) to the host.

        `copy=False` promises that nothing writes the tensors afterwards (temporaries): on CPU they are then
        handed over as they are."""
        if not self.cuda:
            return HostSnapshot({n: t.detach().to("cpu", copy=copy) for n, t in tensors.items()}, None)
        main = torch.cuda.current_stream(self.device)
        assert self.stream is not None
        self.stream.wait_stream(main)  # the copies see every update queued before this point
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.stream):
            for name, t in tensors.items():
                buf = self._buffer(t)
                buf.copy_(t.detach(), non_blocking=True)
                if t.is_cuda:
                    t.record_stream(self.stream)  # a temporary (a delta) must outlive the copy
                out[name] = buf
            event = torch.cuda.Event()
            event.record(self.stream)
        self._fences.append(event)
        return HostSnapshot(out, event, self)

    def fence(self) -> None:
        """Make the compute stream wait for pending snapshot copies before it writes tensors in place."""
        if not self._fences:
            return
        main = torch.cuda.current_stream(self.device)
        for event in self._fences:
            main.wait_event(event)
        self._fences.clear()
