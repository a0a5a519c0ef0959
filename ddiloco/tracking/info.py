"""Where a run's tracking went, read back from its store: for the summary and the report."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ddiloco import keys
from ddiloco.store.base import Store
from ddiloco.tracking.mlflow_run import run_link


def tracking_info(store: Store) -> dict[str, Any]:
    """`tensorboard`: the `tb/` prefix to point TensorBoard at (None when nothing was written), `tensorboard_runs`:
    its runs (roles); `mlflow`: the run's MLflow run and `mlflow_link` (None without one); `dropped_events`:
    per role, the tracking events its processes dropped (backends down or slow)."""
    runs = sorted({k[len(keys.TB) :].split("/", 1)[0] for k in store.list(keys.TB)})
    doc = store.get_json_or_none(keys.MLFLOW_RUN)
    dropped: dict[str, int] = defaultdict(int)
    for key in store.list(f"{keys.TRACKING}stats/"):
        stats = store.get_json_or_none(key) or {}
        if isinstance(stats.get("role"), str) and isinstance(stats.get("dropped"), int):
            dropped[stats["role"]] += stats["dropped"]
    return {
        "tensorboard": f"{store.url}/{keys.TB}" if runs else None,
        "tensorboard_runs": runs,
        "mlflow": doc,
        "mlflow_link": run_link(doc) if isinstance(doc, dict) else None,
        "dropped_events": dict(sorted(dropped.items())),
    }
