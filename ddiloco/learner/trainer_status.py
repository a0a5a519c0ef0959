"""A learner's progress in the status of the Kubeflow Trainer `TrainJob` it runs in (`status.trainerStatus`).

The Trainer (kubeflow/trainer v2.2.0 and later, behind the controller's `TrainJobStatus` feature gate)
gives each trainer container `KUBEFLOW_TRAINER_SERVER_URL`, `KUBEFLOW_TRAINER_SERVER_CA_CERT` and
`KUBEFLOW_TRAINER_SERVER_TOKEN`; a POST of `{"trainerStatus": {...}}` with the token sets the TrainJob's
progress, time left and metrics. Only where those variables are set (`components/trainjob.py`) is anything
sent, and only by the learner process (rank 0); elsewhere `from_env` returns a reporter that does nothing.
It sends merged tokens over the token budget, the time left at the last minute's merged rate
(`ddiloco.tracking.progress`) and the learner's loss, tokens/s and MFU. It never gets in training's way: one post in
flight on its own thread, at most every `MIN_INTERVAL_S`, and a failure is logged once and counted.

Design notes (the Trainer's API as read at v2.3.0): docs/internals.md, "Progress in a Kubeflow TrainJob's
status".
"""

from __future__ import annotations

import json
import logging
import ssl
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ddiloco.learner.efficiency import Efficiency
from ddiloco.protocol.messages import Status
from ddiloco.tracking.progress import rate_and_eta

__all__ = ["ENV_CA_CERT", "ENV_TOKEN", "ENV_URL", "TrainerStatus", "https_post", "trainer_status"]

log = logging.getLogger(__name__)

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MIN_INTERVAL_S = 5.0
"""Seconds between two posts (the Kubeflow SDK's throttle)."""
TIMEOUT_S = 5.0

Post = Callable[[bytes], None]


def trainer_status(
    progress: float, eta_s: float | None, metrics: Mapping[str, float | None], now: datetime
) -> dict[str, Any]:
    """The `UpdateTrainJobStatusRequest` body: `progress` in [0, 1], `eta_s` seconds (None: unknown), the
    metrics that are known as strings (the API's `Metric.value`)."""
    status: dict[str, Any] = {"progressPercentage": max(0, min(100, int(100 * progress)))}
    if eta_s is not None:
        status["estimatedRemainingSeconds"] = max(0, min(2**31 - 1, round(eta_s)))
    status["metrics"] = [{"name": k, "value": f"{v:.6g}"} for k, v in metrics.items() if v is not None]
    status["lastUpdatedTime"] = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"trainerStatus": status}


def https_post(url: str, ca_cert: str, token_file: str) -> Post:
    """A POST to the Trainer's status server; its CA and token are read at every post (both rotate), so a
    file that is not there yet fails that post only."""

    def post(body: bytes) -> None:
        context = ssl.create_default_context(cafile=ca_cert)
        token = Path(token_file).read_text().strip()
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(request, context=context, timeout=TIMEOUT_S) as response:
            response.read()

    return post


class TrainerStatus:
    """Posts the run's progress to the TrainJob's status (module docstring); `post` None: does nothing."""

    def __init__(self, post: Post | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.post, self.clock = post, clock
        self.sent = self.failures = 0
        self._samples: deque[tuple[float, float]] = deque()
        self._last: float | None = None
        self._in_flight: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="trainer-status") if post else None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TrainerStatus:
        """A reporter when the Trainer gave this container its status server, else one that does nothing."""
        url, ca, token = env.get(ENV_URL), env.get(ENV_CA_CERT), env.get(ENV_TOKEN)
        if not (url and ca and token):
            return cls(None)
        log.info("reporting progress to the TrainJob's status at %s", url)
        return cls(https_post(url, ca, token))

    def update(self, status: Status | None, loss: float | None, efficiency: Efficiency) -> None:
        """At a heartbeat: note the run's progress (the syncer's `status`) and post it with the learner's `loss`
        and `efficiency` figures when `MIN_INTERVAL_S` passed and no post is in flight."""
        if self._pool is None or status is None:
            return
        now = self.clock()
        rate, eta = rate_and_eta(self._samples, now, status.tokens_merged, status.token_budget)
        busy = self._in_flight is not None and not self._in_flight.done()
        if busy or (self._last is not None and now - self._last < MIN_INTERVAL_S):
            return
        self._last = now
        body = self._body(status, eta, loss, efficiency)
        self._in_flight = self._pool.submit(self._send, body)

    def _body(self, status: Status, eta: float | None, loss: float | None, efficiency: Efficiency) -> bytes:
        progress = status.tokens_merged / status.token_budget if status.token_budget else 0.0
        metrics = {
            "loss": loss,
            "tokens_per_s": efficiency.tokens_per_s,
            "mfu": efficiency.mfu,
            "tokens_merged": status.tokens_merged,
        }
        return json.dumps(trainer_status(progress, eta, metrics, datetime.now(UTC))).encode()

    def _send(self, body: bytes) -> None:
        assert self.post is not None
        try:
            self.post(body)
            self.sent += 1
        except Exception as e:  # reporting progress must never stop training
            self.failures += 1
            if self.failures == 1:
                log.warning(
                    "could not report progress to the TrainJob's status (%s); training goes on. Check that the "
                    "Trainer's status server is reachable and its TrainJobStatus feature gate is on",
                    e,
                )
            else:
                log.debug("TrainJob status not updated (%s); %d failures", e, self.failures)

    def close(self, status: Status | None, loss: float | None, efficiency: Efficiency) -> None:
        """The learner ends: post its last view of the run (waiting at most the post's timeout), stop the thread."""
        if self._pool is None:
            return
        if self._in_flight is not None:
            wait([self._in_flight], timeout=TIMEOUT_S + 1)
        if status is not None:
            _, eta = rate_and_eta(self._samples, self.clock(), status.tokens_merged, status.token_budget)
            self._send(self._body(status, eta, loss, efficiency))
        self._pool.shutdown(wait=False)
