"""Experiment tracking (`ddiloco.tracking`): event files TensorBoard itself reads back, a tracker that never
waits on a backend that hangs or fails (counted, one warning), and an MLflow file store holding the run's
params, metrics and model."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.config.tracking import TrackingConfig
from ddiloco.platform.ports import free_port
from ddiloco.store.url import open_store
from ddiloco.tracking import tfevents
from ddiloco.tracking.channel import Channel
from ddiloco.tracking.info import tracking_info
from ddiloco.tracking.metrics import TrackingMetrics
from ddiloco.tracking.tensorboard import EventFiles
from ddiloco.tracking.tracker import Tracker, open_tracker


def scalars_read_by_tensorboard(path):
    """tag -> [(step, value)] as TensorBoard's own reader loads a run directory."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(path), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_crc32c_matches_the_castagnoli_check_value():
    assert tfevents.crc32c(b"123456789") == 0xE3069283


def test_event_files_in_the_store_are_what_tensorboard_reads(tmp_path):
    """Segments rotate (a tiny segment size here), each flush rewrites the current one, and TensorBoard
    reads every value back, in order, across the segments and a second process of the same role."""
    store = open_store(tmp_path.as_uri())
    for start, steps in ((1000.0, range(0, 30)), (2000.0, range(30, 40))):  # a process, then its restart
        files = EventFiles(store, "learner-0", started_at=start, segment_bytes=400)
        for step in steps:
            files.write([_scalars({"train/loss": 10.0 / (step + 1), "train/lr": 0.5}, step)])
            if step % 7 == 0:
                files.flush()
        files.close(finished=True)
    names = store.list(f"{keys.TB}learner-0")
    assert len(names) > 3 and all("tfevents" in n for n in names), names
    read = scalars_read_by_tensorboard(tmp_path / "tb" / "learner-0")
    assert [s for s, _ in read["train/loss"]] == list(range(40))
    assert read["train/loss"][9][1] == pytest.approx(1.0) and {v for _, v in read["train/lr"]} == {0.5}


def _scalars(values, step):
    from ddiloco.tracking.channel import Scalars

    return Scalars(values, step, time.time())


class Hung:
    """A backend whose every call waits until released: a tracking server that does not answer."""

    name = "mlflow"

    def __init__(self, fail: bool = False) -> None:
        self.release, self.fail, self.calls = threading.Event(), fail, 0

    def write(self, events):
        self.calls += 1
        if self.fail:
            raise ConnectionError("connection refused")
        self.release.wait(30)

    def flush(self):
        pass

    def close(self, finished):
        pass


def _channel(backend, registry, capacity=8):
    counter = TrackingMetrics(registry).dropped
    return Channel(
        backend,
        capacity=capacity,
        flush_every_s=60,
        on_drop=lambda name, n: counter.labels(backend=name).inc(n),
        hint="Check tracking.mlflow_uri.",
    )


def test_a_backend_that_hangs_never_holds_up_the_caller(caplog):
    registry, backend = CollectorRegistry(), Hung()
    tracker = Tracker("syncer", [_channel(backend, registry)])
    caplog.set_level(logging.WARNING, "ddiloco.tracking")
    t0 = time.perf_counter()
    for step in range(1000):
        tracker.scalars({"round/quorum": 2, "global/learner_loss_mean": float("nan")}, step)
    assert time.perf_counter() - t0 < 0.5  # each call only queues (or drops)
    dropped = registry.get_sample_value("ddiloco_tracking_dropped_events_total", {"backend": "mlflow"})
    assert 1000 - 2 * 8 <= dropped <= 1000 - 8  # the queue holds 8, and the hung write a batch of up to 8
    assert registry.get_sample_value("ddiloco_tracking_dropped_events_total", {"backend": "tensorboard"}) == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "mlflow" in warnings[0].getMessage()
    assert "tracking.mlflow_uri" in warnings[0].getMessage()
    t0 = time.perf_counter()
    tracker.close(timeout=0.2)  # the backend still hangs: the role ends anyway
    assert time.perf_counter() - t0 < 1.0
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    backend.release.set()


def test_a_backend_that_fails_drops_and_counts_each_batch_with_one_warning(caplog):
    registry, backend = CollectorRegistry(), Hung(fail=True)
    tracker = Tracker("posttrain", [_channel(backend, registry, capacity=1000)])
    caplog.set_level(logging.WARNING, "ddiloco.tracking")
    for step in range(50):
        tracker.scalar("eval/final/val_loss", 3.0, step)
        time.sleep(0.002)
    tracker.close(timeout=5)
    assert backend.calls >= 2 and tracker.stats()["dropped"] == 50
    assert registry.get_sample_value("ddiloco_tracking_dropped_events_total", {"backend": "mlflow"}) == 50
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_an_mlflow_file_store_holds_the_runs_params_metrics_and_final_model(tmp_path):
    """The syncer logs the config and its metrics, post-training the validation loss and the final model,
    from two processes into one MLflow run (claimed in the run root); the summary links it."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    store = open_store((tmp_path / "run").as_uri())
    store.put("final/model.safetensors", b"weights")
    store.put("final/meta.json", b"{}")
    uri = (tmp_path / "mlruns").as_uri()
    cfg = TrackingConfig(mlflow_uri=uri, tensorboard=False)
    with open_tracker(store, cfg, "syncer", run_id="r", mlflow=True) as syncer:
        syncer.params({"diloco": {"learners": 2, "quorum": 1}, "run_id": "r"})
        for tokens in (100, 200, 300):
            syncer.scalars({"round/quorum": 2, "global/tokens_merged": tokens}, tokens)
    with open_tracker(store, cfg, "posttrain", run_id="r", mlflow=True) as post:
        post.scalars({"global/val_loss": 3.5}, 300)
        post.artifacts("final/", "final_model")
    doc = store.get_json(keys.MLFLOW_RUN)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(doc["run_id"])
    assert run.data.params["diloco.learners"] == "2" and run.data.tags["ddiloco.run_id"] == "r"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "round/quorum")] == [100, 200, 300]
    assert run.data.metrics["global/val_loss"] == 3.5 and run.info.status == "FINISHED"
    files = {f.path for f in client.list_artifacts(run.info.run_id, "final_model")}
    assert files == {"final_model/model.safetensors", "final_model/meta.json"}
    assert len(client.search_runs([doc["experiment_id"]])) == 1
    assert tracking_info(store)["mlflow_link"].startswith(uri)


def test_an_mlflow_uri_that_does_not_answer_warns_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    """The real MLflow client against a port nothing listens on (its retries off, so it fails at once rather
    than after minutes): every event counted as dropped, one warning, and TensorBoard unaffected."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    port = free_port()  # nothing answers there
    store, registry = open_store((tmp_path / "run").as_uri()), CollectorRegistry()
    cfg = TrackingConfig(mlflow_uri=f"http://127.0.0.1:{port}")
    caplog.set_level(logging.WARNING, "ddiloco.tracking")
    tracker = open_tracker(store, cfg, "syncer", run_id="r", mlflow=True, registry=registry)
    t0 = time.perf_counter()
    for step in range(20):
        tracker.scalars({"round/quorum": 1}, step)
    assert time.perf_counter() - t0 < 0.1
    tracker.close(timeout=20)
    assert registry.get_sample_value("ddiloco_tracking_dropped_events_total", {"backend": "mlflow"}) == 20
    assert registry.get_sample_value("ddiloco_tracking_dropped_events_total", {"backend": "tensorboard"}) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"tracking.mlflow_uri=http://127.0.0.1:{port}" in warnings[0], warnings
    assert tracking_info(store)["dropped_events"] == {"syncer": 20}
    assert len(scalars_read_by_tensorboard(tmp_path / "run" / "tb" / "syncer")["round/quorum"]) == 20
