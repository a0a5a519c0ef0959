"""`Tracker`: what a role logs for experiment tracking (any scalar, the config, model directories), handed to
its backends without ever waiting for them.

Design choices:
- A small generic API (`scalars(values, step)`, `scalar`, `params`, `artifacts`): the roles decide what
  to log and when; a tracker knows no metric names. A value that is None, NaN or infinite is left out.
- Each backend sits behind its own `ddiloco.tracking.channel.Channel` (a bounded queue and a thread), so a
  hung MLflow server never holds up the TensorBoard files, and neither holds up training.
- Steps: a learner logs at its inner step, the syncer and post-training at the global model's tokens merged
  (the run's progress; the same x axis as the report's loss curve and comparable across runs of any M).
- MLflow is for the roles that speak for the whole run (syncer, post-training: `mlflow=True`); learners
  write TensorBoard only, so M learners add no load on the MLflow server.
- `OFF` (no backend) is what every role holds until its command opens a real tracker: library code and
  in-process tests log into it for free.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.config.tracking import TrackingConfig
from ddiloco.store.base import Store
from ddiloco.tracking.channel import Artifacts, Channel, Params, Scalars
from ddiloco.tracking.metrics import TrackingMetrics
from ddiloco.tracking.mlflow_run import MlflowRun, flat_params
from ddiloco.tracking.tensorboard import EventFiles

log = logging.getLogger(__name__)

CLOSE_S = 10.0
"""Seconds each backend may take to deliver what is queued when a role ends."""


class Tracker:
    def __init__(
        self, role: str, channels: list[Channel] | None = None, close_timeout: float = CLOSE_S
    ) -> None:
        """`close_timeout`: how long each backend may take to deliver what is queued when the role ends."""
        self.role = keys.tracking_role(role)
        self.channels: list[Channel] = channels if channels is not None else []
        self.close_timeout = close_timeout

    @property
    def enabled(self) -> bool:
        return bool(self.channels)

    def scalars(
        self, values: Mapping[str, float | int | None], step: float, wall_time: float | None = None
    ) -> None:
        """Log `values` (name -> number; None, NaN, inf and anything not a number left out) at `step` (an
        int ≥ 0)."""
        if not self.channels:
            return
        clean = {
            k: float(v)
            for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        if clean:
            event = Scalars(clean, max(0, int(step)), time.time() if wall_time is None else wall_time)
            for ch in self.channels:
                ch.put(event)

    def scalar(self, name: str, value: float | int | None, step: float) -> None:
        self.scalars({name: value}, step)

    def params(self, tree: Mapping[str, Any]) -> None:
        """The run's settings (a nested dict, e.g. the resolved config), flattened to `section.key`."""
        if self.channels:
            event = Params(flat_params(dict(tree)))
            for ch in self.channels:
                ch.put(event)

    def artifacts(self, prefix: str, name: str) -> None:
        """Every object under the store prefix `prefix` (a model directory), logged as artifacts `name`."""
        if self.channels:
            for ch in self.channels:
                ch.put(Artifacts(prefix, name))

    def stats(self) -> dict[str, Any]:
        by = {ch.backend.name: dict(ch.stats) for ch in self.channels}
        return {
            "written": sum(s["written"] for s in by.values()),
            "dropped": sum(s["dropped"] for s in by.values()),
            "backends": by,
        }

    def close(self, timeout: float | None = None, finished: bool = True) -> None:
        """Deliver what is queued (each backend within `timeout` seconds, default `close_timeout`) and stop;
        `finished`: the role ended normally (MLflow marks the run FINISHED)."""
        for ch in self.channels:  # MLflow first: the tensorboard backend writes the stats of all at its close
            ch.close(self.close_timeout if timeout is None else timeout, finished)
        if self.channels and (dropped := self.stats()["dropped"]):
            log.info("tracking: %s dropped %d events in all (see the warning above)", self.role, dropped)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.close(finished=exc_type is None)


OFF = Tracker("off")


def open_tracker(
    store: Store | str,
    cfg: TrackingConfig,
    role: str,
    *,
    run_id: str,
    mlflow: bool = False,
    registry: CollectorRegistry | None = None,
    close_timeout: float = CLOSE_S,
) -> Tracker:
    """The tracker of `role` (`syncer`, `learner-3`, `posttrain`) of run `run_id` whose root is `store` (a
    Store, or its URL: opened on the tracking thread). `mlflow`: this role logs to `cfg.mlflow_uri` too.
    `registry`: where `ddiloco_tracking_dropped_events_total` is counted (the role's /metrics);
    `close_timeout`: see `Tracker`."""
    keys.tracking_role(role)
    counter = TrackingMetrics(registry if registry is not None else CollectorRegistry()).dropped
    channels: list[Channel] = []
    tracker = Tracker(role, channels, close_timeout)

    def channel(backend: Any, hint: str) -> Channel:
        on_drop = lambda name, n: counter.labels(backend=name).inc(n)  # noqa: E731
        return Channel(
            backend, capacity=cfg.queue_events, flush_every_s=cfg.flush_every_s, on_drop=on_drop, hint=hint
        )

    if mlflow and cfg.mlflow_uri:
        backend = MlflowRun(cfg.mlflow_uri, cfg.mlflow_experiment, store, run_id, role)
        channels.append(channel(backend, f"Check that tracking.mlflow_uri={cfg.mlflow_uri} answers."))
    if cfg.tensorboard:
        files = EventFiles(store, role, stats=tracker.stats)
        channels.append(channel(files, "Check that the run root's store answers."))
    where = store if isinstance(store, str) else store.url
    if channels:
        log.info(
            "tracking %s: %s%s",
            role,
            f"TensorBoard {where}/{keys.TB}{role}/" if cfg.tensorboard else "no TensorBoard",
            f", MLflow {cfg.mlflow_uri}" if mlflow and cfg.mlflow_uri else "",
        )
    return tracker
