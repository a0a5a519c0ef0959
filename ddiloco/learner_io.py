"""The learner's helpers around the loop: status poller, incarnations, history, checkpoints off the loop.

Design choices:
- The poller thread keeps the newest syncer status in memory and survives an unavailable store with
  backoff; the training loop only ever reads `latest`.
- A checkpoint is snapshotted at a step boundary into host buffers (`ddiloco.accel.HostCopier`: pinned and
  asynchronous on CUDA) and written by an I/O thread, which rebuilds a parameter-less model on the meta
  device around the host tensors: no random init, no second copy of the model, nothing on the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ddiloco import wire
from ddiloco.accel import HostCopier, HostSnapshot
from ddiloco.checkpoint import load_optimizer_tensors, optimizer_tensors, save_learner_checkpoint
from ddiloco.compression import encode
from ddiloco.globalmodel import Layout
from ddiloco.model import GPT, configure_optimizer
from ddiloco.store import Store, StoreError

log = logging.getLogger(__name__)

HISTORY_POINTS = 400
HISTORY_EVERY_S = 1.0


def next_incarnation(store: Store, learner_id: int, started_at: float) -> int:
    """Claim this start's incarnation number (previous + 1, or 0)."""
    prev = store.get_json_or_none(wire.incarnation_key(learner_id))
    inc = 0 if prev is None else int(prev["incarnation"]) + 1
    store.put_json(wire.incarnation_key(learner_id), {"incarnation": inc, "started_at": started_at})
    return inc


def sample_history(
    history: list[list[float]], loss_ema: float | None, inner_step: int, tokens: int
) -> list[list[float]]:
    """Append the current point to `history` (in place, at most every HISTORY_EVERY_S); keep at most
    HISTORY_POINTS by dropping every other old point; return a copy."""
    if loss_ema is not None and (not history or time.time() - history[-1][0] >= HISTORY_EVERY_S):
        history.append([time.time(), inner_step, tokens, loss_ema])
        if len(history) > HISTORY_POINTS:
            history[:] = history[:-1:2] + history[-1:]
    return list(history)


class StatusPoller(threading.Thread):
    """Keeps the newest syncer status in memory; survives an unavailable store with backoff."""

    def __init__(self, store: Store, every: float, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="status-poller")
        self.store, self.every, self.stop = store, every, stop
        self.latest: dict[str, Any] | None = None
        self.errors = 0

    def poll_once(self) -> None:
        status = self.store.get_json_or_none(wire.STATUS)
        if status is not None:
            self.latest = status

    def run(self) -> None:
        delay = self.every
        while not self.stop.is_set():
            try:
                self.poll_once()
                delay = self.every
            except StoreError as e:
                self.errors += 1
                delay = min(5.0, max(delay * 2, 0.2))
                log.warning("status poll failed (%s); retrying in %.1fs, training continues", e, delay)
            self.stop.wait(delay)


def pack_update(snap: HostSnapshot, codec: str, header: dict, key: bytes | None) -> bytes:
    """An answer's payload: the delta snapshot encoded with the upload codec, packed and signed (on an I/O
    thread); the snapshot's buffers are released."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, d in snap.wait().items():
            for part, t in encode(d, codec).items():
                tensors[f"{name}/{part}"] = t
        return wire.pack(tensors, header, key=key)
    finally:
        snap.release()


def snapshot_checkpoint(
    copier: HostCopier, model: torch.nn.Module, opt: torch.optim.Optimizer
) -> HostSnapshot:
    """Parameters (`param/{name}`) and AdamW state (`opt/{name}/{field}`) copied to the host."""
    tensors = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    tensors.update(optimizer_tensors(model, opt))
    return copier.snapshot(tensors)


class CheckpointWriter:
    """Writes checkpoint snapshots on the I/O pool one at a time, in step order. A snapshot still waiting when
    a newer one arrives is dropped for it: at most two exist (one being written, the newest waiting), so a
    slow store never piles them up, and the newest state is always the next written."""

    def __init__(self, store: Store, learner_id: int, layout: Layout, key: bytes | None) -> None:
        self.store, self.learner_id, self.layout, self.key = store, learner_id, layout, key
        self._write_lock, self._slot_lock = threading.Lock(), threading.Lock()
        self._waiting: tuple[int, HostSnapshot, dict[str, Any]] | None = None

    def submit(self, pool: ThreadPoolExecutor, step: int, snap: HostSnapshot, meta: dict[str, Any]) -> None:
        with self._slot_lock:
            dropped, self._waiting = self._waiting, (step, snap, meta)
        if dropped is None:  # no writer is waiting for the slot: start one
            pool.submit(self._drain)
        else:  # the waiting writer takes the new snapshot instead
            dropped[1].wait()
            dropped[1].release()

    def _drain(self) -> None:
        with self._write_lock:
            with self._slot_lock:
                job, self._waiting = self._waiting, None
            if job is not None:
                step, snap, meta = job
                write_checkpoint(self.store, self.learner_id, step, self.layout, snap, meta, self.key)


def write_checkpoint(
    store: Store,
    learner_id: int,
    step: int,
    layout: Layout,
    snap: HostSnapshot,
    meta: dict[str, Any],
    key: bytes | None,
) -> None:
    """Write a snapshot as a learner checkpoint; a store error is logged, not raised."""
    try:
        tensors = snap.wait()
        with torch.device("meta"):
            model = GPT(layout.gpt_config())
        params = {k[len("param/") :]: v for k, v in tensors.items() if k.startswith("param/")}
        model.load_state_dict(params, assign=True)
        opt = configure_optimizer(model, 1.0, 0.0, fused=False)
        load_optimizer_tensors(model, opt, tensors)
        save_learner_checkpoint(store, learner_id, step, model, opt, meta, key=key)
    except StoreError as e:
        log.warning("learner %d: checkpoint at step %d failed (%s)", learner_id, step, e)
    finally:
        snap.release()
