"""A role's TensorBoard run in the store: event files under `tb/{role}/`, uploaded through the Store API.

Design choices:
- Event files are encoded here (`ddiloco.tracking.tfevents`) rather than by `torch.utils.tensorboard`'s
  SummaryWriter: that needs the `tensorboard` package (protobuf, grpcio, ...) in every image that trains,
  and writes to a local directory that would then have to be mirrored to S3. Building the records in
  memory and putting them through the `Store` works the same on `file://` and `s3://` run roots, and what
  Kubeflow's Tensorboards app (or `tensorboard --logdir s3://bucket/run/tb/`) reads is the store itself.
- S3 objects cannot be appended to, so a process writes *segments*: the current one is rewritten whole at
  each flush (at most `SEGMENT_BYTES`), then sealed and the next one begun. Names sort in write order
  (process start in ms, then the segment number), which is how TensorBoard reads a run's files: one after
  the other, each from its start. Segments go up in order; a failed upload keeps them all and is retried
  at the next flush, up to `MAX_PENDING_BYTES` held in memory (past that, new events are refused: dropped
  and counted by the channel).
- A process killed by SIGKILL loses at most its last flush interval, as shipped logs do (`ddiloco.logship`).
- The store is opened on the first flush, in the tracking thread, when given as a URL: a role never waits
  on it. A store of its own, too: its I/O does not count in the role's traffic or retries.
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
