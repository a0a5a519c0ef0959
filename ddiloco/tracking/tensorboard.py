"""A role's TensorBoard run in the store: event files under `tb/{role}/`, uploaded through the Store API.

Event files are encoded here (`ddiloco.tracking.tfevents`), not by `torch.utils.tensorboard`, so no image
that trains needs the `tensorboard` package and nothing is mirrored from a local directory: what TensorBoard
reads is the store itself, on `file://` and `s3://` alike. S3 objects cannot be appended to, so a process
writes segments, rewriting the current one whole at each flush up to `SEGMENT_BYTES`; names sort in write
order, as TensorBoard reads them. A failed upload is retried at the next flush, up to `MAX_PENDING_BYTES`. A
SIGKILLed process loses at most its last flush interval. The store is opened on the first flush, in the
tracking thread, and is a store of its own, so its I/O never counts in the role's traffic.

Design notes: docs/internals.md, "Experiment tracking backends"; what a user sees: docs/tracking.md.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from ddiloco import keys
from ddiloco.store.base import Store
from ddiloco.store.url import open_store
from ddiloco.tracking import tfevents
from ddiloco.tracking.channel import Event, Scalars

SEGMENT_BYTES = 1 << 20
MAX_PENDING_BYTES = 16 << 20


class EventFiles:
    """The tensorboard backend of a `ddiloco.tracking.channel.Channel` (see the module docstring)."""

    name = "tensorboard"

    def __init__(
        self,
        store: Store | str,
        role: str,
        *,
        started_at: float | None = None,
        segment_bytes: int = SEGMENT_BYTES,
        stats: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        """`stats`: what the tracker wrote and dropped, written next to the event files at close."""
        keys.tracking_role(role)
        self.role, self.segment_bytes, self.stats = role, segment_bytes, stats
        started = time.time() if started_at is None else started_at
        self.stem = f"{int(started * 1000):013d}.{role}.{os.getpid()}-{secrets.token_hex(3)}"
        self._target = store
        self._store: Store | None = None
        self._segments: list[list[Any]] = []  # [number, bytearray, bytes uploaded], oldest first
        self._next = 0

    def key(self, number: int) -> str:
        return keys.tb_key(self.role, f"events.out.tfevents.{self.stem}.{number:04d}")

    def write(self, events: list[Event]) -> None:
        pending = sum(len(s[1]) - s[2] for s in self._segments)
        if pending > MAX_PENDING_BYTES:
            raise OSError(f"{pending} bytes of event files not uploaded yet: the store does not take them")
        for ev in events:
            if isinstance(ev, Scalars):
                rec = tfevents.scalars_event(ev.values, ev.step, ev.wall_time)
                seg = self._segment(len(rec), ev.wall_time)
                seg[1] += rec

    def _segment(self, size: int, wall_time: float) -> list[Any]:
        if not self._segments or len(self._segments[-1][1]) + size > self.segment_bytes:
            self._segments.append([self._next, bytearray(tfevents.file_version_event(wall_time)), 0])
            self._next += 1
        return self._segments[-1]

    def _open(self) -> Store:
        if self._store is None:
            self._store = open_store(self._target) if isinstance(self._target, str) else self._target
        return self._store

    def flush(self) -> None:
        while self._segments:
            number, data, sent = seg = self._segments[0]
            if sent < len(data):
                self._open().put(self.key(number), bytes(data))
                seg[2] = len(data)
            if len(self._segments) == 1:
                return
            self._segments.pop(0)  # sealed and uploaded

    def close(self, finished: bool) -> None:
        self.flush()
        if self.stats is not None:
            doc = {"role": self.role, "time": time.time(), "finished": finished, **self.stats()}
            self._open().put(keys.tracking_stats_key(self.role, self.stem), json.dumps(doc).encode())
