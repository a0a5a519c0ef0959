"""The `tracking` section of the run config: TensorBoard event files and an optional MLflow run.

It lives here, next to the tracker, and raises `ddiloco.errors.ConfigError`; the config imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ddiloco.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class TrackingConfig:
    tensorboard: bool = True
    """Write TensorBoard event files under the run root's `tb/` prefix, one run per role (`tb/syncer`,
    `tb/learner-0`, `tb/posttrain`): point TensorBoard (or Kubeflow's Tensorboards app) at `RUN_ROOT/tb/`."""
    mlflow_uri: str | None = None
    """MLflow tracking URI (http(s)://server, databricks, file:///dir): the syncer and post-training log the
    config as params, their metrics, and the final and SFT models as artifacts. Needs the `mlflow` extra
    (`pip install 'ddiloco[mlflow]'`); null: no MLflow."""
    mlflow_experiment: str = "ddiloco"
    """MLflow experiment the run is logged under (created when missing)."""
    flush_every_s: float = 10.0
    """Seconds between uploads of the event files to the store (and at exit)."""
    queue_events: int = 10_000
    """Events each backend may have waiting; when a backend is down or slow, newer ones are dropped and
    counted (`ddiloco_tracking_dropped_events_total`): tracking never makes training wait."""

    def validate(self) -> None:
        if self.mlflow_uri is not None and (
            not isinstance(self.mlflow_uri, str) or not self.mlflow_uri.strip()
        ):
            raise ConfigError(
                "tracking.mlflow_uri must be an MLflow tracking URI (e.g. http://mlflow:5000, file:///dir) "
                "or null"
            )
        if not self.mlflow_experiment.strip():
            raise ConfigError("tracking.mlflow_experiment must name an experiment, e.g. ddiloco")
        if not (math.isfinite(self.flush_every_s) and self.flush_every_s > 0):
            raise ConfigError(f"tracking.flush_every_s={self.flush_every_s} must be > 0 seconds (e.g. 10)")
        if self.queue_events < 1:
            raise ConfigError(f"tracking.queue_events={self.queue_events} must be ≥ 1 (e.g. 10000)")
