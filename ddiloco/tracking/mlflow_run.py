"""The run's MLflow run: params, metrics and model artifacts, for the syncer and post-training.

One MLflow run per ddiloco run, whatever the number of processes: the first role that logs creates it and
claims `tracking/mlflow.json` with `Store.create`; the others log into it, and a role that lost the race
deletes the run it created. `MlflowClient(tracking_uri=...)` keeps no process-wide state, and everything runs
on the channel's thread (`ddiloco.tracking.channel`), so a server that does not answer only fills that queue.
A `file://` URI sets MLFLOW_ALLOW_FILE_STORE=true, which MLflow 3 requires for it. Metrics and params go in
`log_batch` requests within MLflow's limits; artifacts are store prefixes copied in bounded chunks.
Without the `mlflow` extra every batch fails with one warning saying what to install.

Design notes: docs/internals.md, "Experiment tracking backends"; what a user sees: docs/tracking.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ddiloco import keys
from ddiloco.store.base import Store
from ddiloco.store.url import open_store
from ddiloco.tracking.channel import Artifacts, Event, Params, Scalars

MAX_METRICS, MAX_PARAMS, MAX_PARAM_CHARS = 1000, 100, 500
CHUNK = 64 << 20


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"diloco": {"quorum": 1}}` -> `{"diloco.quorum": "1"}`; values cut at MAX_PARAM_CHARS."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= flat_params(v, f"{prefix}{k}.")
        else:
            text = str(v)
            out[f"{prefix}{k}"] = (
                text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 3] + "..."
            )
    return out


def run_link(doc: dict[str, Any]) -> str:
    """Where a person finds the run: the UI page for an http(s) server, else the tracking URI and run id."""
    uri, exp, run = doc.get("tracking_uri", ""), doc.get("experiment_id"), doc.get("run_id")
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/#/experiments/{exp}/runs/{run}"
    return f"{uri} (experiment {exp}, run {run})"


class MlflowRun:
    """The mlflow backend of a `ddiloco.tracking.channel.Channel` (see the module docstring)."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, store: Store | str, run_id: str, role: str) -> None:
        self.uri, self.experiment, self.run_name, self.role = uri, experiment, run_id, role
        self._target = store
        self._client: Any = None
        self.run_id: str | None = None

    # --- opening (on the channel's thread) ------------------------------------------------------------------
    def _open(self) -> tuple[Any, str]:
        if self._client is None:
            try:
                from mlflow import MlflowClient
            except ImportError as e:
                raise RuntimeError(
                    f"tracking.mlflow_uri is set but MLflow is not installed ({e}): pip install 'ddiloco[mlflow]'"
                ) from e
            if self.uri.startswith("file:"):
                os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self._client = MlflowClient(tracking_uri=self.uri)
        if self.run_id is None:
            self.run_id = self._claim(self._client)
        return self._client, self.run_id

    def _claim(self, client: Any) -> str:
        store = open_store(self._target) if isinstance(self._target, str) else self._target
        self._target = store
        doc = store.get_json_or_none(keys.MLFLOW_RUN)
        if doc is not None and doc.get("tracking_uri") == self.uri:
            return str(doc["run_id"])
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        run = client.create_run(exp_id, run_name=self.run_name, tags={"ddiloco.run_id": self.run_name})
        mine = {"tracking_uri": self.uri, "experiment_id": exp_id, "run_id": run.info.run_id}
        mine["artifact_uri"] = run.info.artifact_uri
        if doc is None and store.create_json(keys.MLFLOW_RUN, mine):
            return run.info.run_id
        if doc is None:  # another role claimed it first: log there
            client.delete_run(run.info.run_id)
            return str(store.get_json(keys.MLFLOW_RUN)["run_id"])
        store.put_json(keys.MLFLOW_RUN, mine)  # the config names another server now: the run starts there
        return run.info.run_id

    # --- the backend ----------------------------------------------------------------------------------------
    def write(self, events: list[Event]) -> None:
        from mlflow.entities import Metric, Param

        client, run_id = self._open()
        metrics = [
            Metric(k, v, int(ev.wall_time * 1000), ev.step)
            for ev in events
            if isinstance(ev, Scalars)
            for k, v in ev.values.items()
        ]
        params = [Param(k, v) for ev in events if isinstance(ev, Params) for k, v in ev.values.items()]
        for i in range(0, len(metrics), MAX_METRICS):
            client.log_batch(run_id, metrics=metrics[i : i + MAX_METRICS])
        for i in range(0, len(params), MAX_PARAMS):
            client.log_batch(run_id, params=params[i : i + MAX_PARAMS])
        for ev in events:
            if isinstance(ev, Artifacts):
                self._artifacts(client, run_id, ev)

    def _artifacts(self, client: Any, run_id: str, ev: Artifacts) -> None:
        store: Store = self._target  # type: ignore[assignment]  # opened by `_claim`
        found = store.list(ev.prefix)
        if not found:
            return
        with tempfile.TemporaryDirectory(prefix="ddiloco-mlflow-") as tmp:
            for key in found:
                path = Path(tmp, key[len(ev.prefix) :].lstrip("/"))
                path.parent.mkdir(parents=True, exist_ok=True)
                size = store.size(key)
                with path.open("wb") as f:
                    for offset in range(0, size, CHUNK):
                        f.write(store.get_range(key, offset, min(CHUNK, size - offset)))
            client.log_artifacts(run_id, tmp, ev.name)

    def flush(self) -> None:
        """Every batch is sent as it is written."""

    def close(self, finished: bool) -> None:
        if finished and self.run_id is not None:
            self._client.set_terminated(self.run_id, "FINISHED", end_time=int(time.time() * 1000))
