"""Fragment-sized fp32 buffers handed from closed rounds to new ones.

A fresh allocation of a fragment's size is paid in page faults at its first write (~1.7 GB/s against ~20
GB/s for memory written before: `benchmarks/syncer_scale.py`), and the syncer's fragments are of nearly
equal size, so a buffer given back by one round fits the next round of almost any fragment. Buffers are flat
(the borrower carves per-tensor views); `take` picks the smallest free buffer that holds the request within
`slack`, else allocates; `give` keeps at most `keep` free buffers. Contents are undefined on `take`, and a
buffer must not be used after it is given back.

Design notes: docs/internals.md, "Buffers handed between rounds".
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor


class BufferPool:
    def __init__(self, keep: int = 2, slack: float = 0.25) -> None:
        self.keep, self.slack = keep, slack
        self._free: list[Tensor] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0

    def take(self, numel: int) -> Tensor:
        """A flat fp32 tensor of `numel` values (contents undefined)."""
        with self._lock:
            fits = [b for b in self._free if numel <= b.numel() <= numel * (1 + self.slack)]
            if fits:
                buf = min(fits, key=Tensor.numel)
                self._free = [b for b in self._free if b is not buf]
                self.reused += 1
                return buf[:numel]
            self.allocated += 1
        return torch.empty(numel, dtype=torch.float32)

    def give(self, buf: Tensor) -> None:
        """Hand back a buffer from `take` (a flat view of it is fine: its whole storage is reused)."""
        whole = torch.empty(0, dtype=torch.float32).set_(buf.untyped_storage())
        with self._lock:
            self._free.append(whole)
            self._free.sort(key=Tensor.numel, reverse=True)
            del self._free[self.keep :]  # keep the largest: they fit the most requests


SYNCER_POOL = BufferPool(keep=6)
"""The pool a syncer process's rounds share (`GlobalFragment.new_sums`)."""


def carve(flat: Tensor, shapes: dict[str, torch.Size]) -> dict[str, Tensor]:
    """Per-tensor views of one flat fp32 buffer, in name order (it must hold all of them)."""
    out, at = {}, 0
    for name in sorted(shapes):
        n = shapes[name].numel()
        out[name] = flat[at : at + n].view(shapes[name])
        at += n
    return out


class Loan:
    """Byte buffers lent out of a pool for reads into reused memory (`ddiloco.store.Store.get_into`: call
    it with a size), all given back by `give_back` once nothing uses what was read into them."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.taken: list[Tensor] = []

    def __call__(self, nbytes: int) -> memoryview:
        buf = self.pool.take((nbytes + 3) // 4)
        self.taken.append(buf)
        return memoryview(buf.view(torch.uint8).numpy())

    def give_back(self) -> None:
        for buf in self.taken:
            self.pool.give(buf)
        self.taken.clear()
