"""A learner in a Kubeflow Trainer TrainJob reports the run's progress in the TrainJob's status (issue 52 item 2),
in the shape kubeflow/trainer's `UpdateTrainJobStatusRequest` has (pkg/apis/trainer/v1alpha1/trainjob_types.go),
throttled, and without ever stopping training."""

from __future__ import annotations

import json
import logging
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from ddiloco.learner.trainer_status import (
    ENV_CA_CERT,
    ENV_TOKEN,
    ENV_URL,
    TrainerStatus,
    https_post,
    trainer_status,
)
from tests._harness import status

EFFICIENCY = SimpleNamespace(tokens_per_s=6100.0, mfu=None)  # what it reads of `ddiloco.learner.efficiency`


def test_the_body_is_an_update_trainjob_status_request():
    now = datetime(2026, 6, 12, 3, 0, tzinfo=UTC)
    body = trainer_status(0.456, 3600.4, {"loss": 2.3456789, "mfu": None}, now)
    assert body == {
        "trainerStatus": {
            "progressPercentage": 45,
            "estimatedRemainingSeconds": 3600,
            "metrics": [{"name": "loss", "value": "2.34568"}],  # unknown figures are left out
            "lastUpdatedTime": "2026-06-12T03:00:00Z",
        }
    }
    unknown = trainer_status(1.7, None, {}, now)["trainerStatus"]
    assert unknown["progressPercentage"] == 100 and "estimatedRemainingSeconds" not in unknown


def test_outside_a_trainjob_nothing_is_sent():
    reporter = TrainerStatus.from_env(
        {ENV_URL: "https://trainer:10443/x"}
    )  # no CA, no token: not the Trainer's
    reporter.update(status(tokens_merged=10, token_budget=100), 2.0, EFFICIENCY)
    reporter.close(status(tokens_merged=10, token_budget=100), 2.0, EFFICIENCY)
    assert reporter.post is None and reporter.sent == 0
    both = {ENV_URL: "https://t/status", ENV_CA_CERT: "/ca.crt", ENV_TOKEN: "/token"}
    assert TrainerStatus.from_env(both).post is not None


def test_progress_is_posted_at_most_every_five_seconds_with_the_eta():
    bodies, now = [], [0.0]
    reporter = TrainerStatus(lambda b: bodies.append(json.loads(b)), clock=lambda: now[0])
    for t in range(0, 12):  # a heartbeat a second, 100 tokens merged a second
        now[0] = float(t)
        reporter.update(status(tokens_merged=100.0 * t, token_budget=10_000), 2.5, EFFICIENCY)
        reporter._in_flight.result(timeout=5)
    assert len(bodies) == 3  # t = 0, 5, 10
    last = bodies[-1]["trainerStatus"]
    assert last["progressPercentage"] == 10 and last["estimatedRemainingSeconds"] == 90
    assert {m["name"]: m["value"] for m in last["metrics"]} == {
        "loss": "2.5",
        "tokens_per_s": "6100",
        "tokens_merged": "1000",
    }
    reporter.close(status(tokens_merged=10_000.0, token_budget=10_000), 2.0, EFFICIENCY)
    assert bodies[-1]["trainerStatus"]["progressPercentage"] == 100


def test_a_status_server_that_fails_is_logged_once_and_training_goes_on(caplog):
    now = [0.0]

    def refused(body: bytes) -> None:
        raise ConnectionRefusedError("connection refused")

    reporter = TrainerStatus(refused, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="ddiloco.learner.trainer_status"):
        for t in (0.0, 6.0, 12.0):
            now[0] = t
            reporter.update(status(tokens_merged=t, token_budget=100), None, EFFICIENCY)  # never raises
            reporter._in_flight.result(timeout=5)
    assert reporter.failures == 3 and reporter.sent == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "TrainJobStatus feature gate" in warnings[0].getMessage()


def test_the_post_carries_the_token_read_at_each_post(tmp_path):
    """Against a local HTTP server (the Trainer's is HTTPS; the CA only matters there): method, path, header, body."""
    certifi = pytest.importorskip("certifi")
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, self.headers["Authorization"], json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("jwt-1\n")
    path = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/learner-0/status"
    post = https_post(f"http://127.0.0.1:{server.server_port}{path}", certifi.where(), str(token))
    post(json.dumps({"trainerStatus": {"progressPercentage": 5}}).encode())
    server.server_close()
    assert seen == [(path, "Bearer jwt-1", {"trainerStatus": {"progressPercentage": 5}})]
