"""The run's pace as the syncer's status shows it: merged tokens per second over a recent window, and the
time left to the token budget at that pace. Read by `ddiloco run`'s progress line and by the learner's
Kubeflow Trainer status (`ddiloco.learner.trainer_status`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddiloco.protocol.messages import Status

RATE_WINDOW_S = 60.0
"""Merged tokens per second are measured over the last minute of progress (a run's rate drifts)."""


@dataclass(frozen=True, slots=True)
class Progress:
    """What `ddiloco.launch.LocalRun.run` tells its `on_progress` callback on every pass of its loop."""

    status: Status | None
    """The syncer's newest status (None before the first one)."""
    elapsed: float
    """Seconds since the run was prepared."""
    processes: int
    """Processes of the run running now."""


def rate_and_eta(
    samples: deque[tuple[float, float]], elapsed: float, merged: float, budget: float
) -> tuple[float | None, float | None]:
    """(merged tokens per second over the last `RATE_WINDOW_S`, seconds left to the budget at that rate);
    None until two samples a second apart exist or while nothing merges. `samples` is updated."""
    samples.append((elapsed, merged))
    while len(samples) > 2 and elapsed - samples[1][0] >= RATE_WINDOW_S:
        samples.popleft()
    (t0, m0), (t1, m1) = samples[0], samples[-1]
    if t1 - t0 < 1.0 or m1 <= m0:
        return None, None
    rate = (m1 - m0) / (t1 - t0)
    return rate, max(0.0, budget - merged) / rate
