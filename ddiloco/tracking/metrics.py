"""Prometheus metrics for learners and the syncer; registries are passed in, never global.

Design choices:
- One small class per role owns its metric objects in a registry it is given, so tests read values back
  with `registry.get_sample_value(...)` and two roles in one process never collide.
- Values that are really state (tokens merged, goodput and merged-token share, live learners, global
  versions) are exported by a collector that reads the role's state at scrape time, so the exported number
  is the ledger itself, even across a restart.
- Names follow Prometheus conventions: `ddiloco_` prefix, `_total` for counters, base units (seconds,
  bytes). Every name the dashboard uses appears in `METRIC_NAMES` (a test checks the dashboard against it).
- `serve()` binds an HTTP `/metrics` endpoint; `push()` sends a short-lived task's registry to a
  Pushgateway when one is configured.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, push_to_gateway, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
QUORUM_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
STEPS_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
IO_KINDS = ("upload", "heartbeat", "checkpoint", "download", "record")
"""What a learner's I/O threads do (`ddiloco.learner.health`): the `kind` of `ddiloco_learner_io_errors_total`."""


class LearnerMetrics:
    def __init__(
        self, registry: CollectorRegistry, learner_id: int, incarnation: int, site: str = "local"
    ) -> None:
        lbl = {"learner_id": str(learner_id)}
        ns = "ddiloco_learner"
        self.inner_steps = Counter(
            f"{ns}_inner_steps", "Inner optimizer steps", ["learner_id"], registry=registry
        ).labels(**lbl)
        self.tokens = Counter(
            f"{ns}_tokens", "Tokens processed by inner steps", ["learner_id"], registry=registry
        ).labels(**lbl)
        self.loss = Gauge(
            f"{ns}_loss", "Training loss of the last inner step", ["learner_id"], registry=registry
        ).labels(**lbl)
        self.learning_rate = Gauge(
            f"{ns}_learning_rate",
            "Inner learning rate of the last step (ddiloco.run.schedule)",
            ["learner_id"],
            registry=registry,
        ).labels(**lbl)
        self.tokens_per_second = Gauge(
            f"{ns}_tokens_per_second",
            "Processed tokens per second (all ranks): a step's tokens over the loop's wall seconds per step "
            "(EMA, loop overhead included; compute time alone until that is measured)",
            ["learner_id"],
            registry=registry,
        ).labels(**lbl)
        # Efficiency (`ddiloco.learner.efficiency`); the MFU and peak series exist only where the peak is known.
        self.mfu = Gauge(
            f"{ns}_mfu",
            "Model FLOPs utilization: FLOPs per token (6N + 12LCT) x processed tokens/s / peak FLOP/s of the "
            "learner's devices (train.peak_flops or the data-sheet figure for the GPU); absent when unknown",
            ["learner_id"],
            registry=registry,
        )
        self.peak_flops = Gauge(
            f"{ns}_peak_flops",
            "Peak FLOP/s of the learner's devices together (one device's x ranks) that MFU divides by",
            ["learner_id"],
            registry=registry,
        )
        self.peak_memory = Gauge(
            f"{ns}_peak_memory_bytes",
            "Peak memory of the learner: kind cuda_max_allocated (torch.cuda.max_memory_allocated of its "
            "device) or peak_rss (the process's peak resident set, on CPU)",
            ["learner_id", "kind"],
            registry=registry,
        )
        self.data_wait_seconds = Counter(
            f"{ns}_data_wait_seconds",
            "Seconds inner steps waited for their next batch (data loader); over step_seconds: the wait fraction",
            ["learner_id"],
            registry=registry,
        ).labels(**lbl)
        self.step_seconds = Counter(
            f"{ns}_step_seconds",
            "Seconds spent in inner steps, data wait included",
            ["learner_id"],
            registry=registry,
        ).labels(**lbl)
        self.rounds_answered = Counter(
            f"{ns}_rounds_answered", "Rounds answered with an upload", ["learner_id"], registry=registry
        ).labels(**lbl)
        self.uploaded = Counter(
            f"{ns}_uploaded_bytes", "Bytes of fragment updates uploaded", ["learner_id"], registry=registry
        ).labels(**lbl)
        self.downloaded = Counter(
            f"{ns}_downloaded_bytes",
            "Bytes of global fragments downloaded",
            ["learner_id"],
            registry=registry,
        ).labels(**lbl)
        self.upload_failures = Counter(
            f"{ns}_upload_failures", "Uploads that failed after retries", ["learner_id"], registry=registry
        ).labels(**lbl)
        self.io_errors = Counter(
            f"{ns}_io_errors",
            "Exceptions other than store errors raised in the learner's I/O threads (bugs), by kind",
            ["learner_id", "kind"],
            registry=registry,
        )
        for kind in IO_KINDS:  # exported from 0, so that an alert on any increase sees the first one
            self.io_errors.labels(learner_id=str(learner_id), kind=kind)
        self.rejected = Counter(  # kind: global (refused here) or update (refused by the syncer)
            f"{ns}_rejected",
            "Objects rejected, by kind and reason",
            ["learner_id", "kind", "reason"],
            registry=registry,
        )
        self.store_retries = Gauge(
            f"{ns}_store_retries", "Store operations retried (cumulative)", ["learner_id"], registry=registry
        ).labels(**lbl)
        self.staleness = Gauge(
            f"{ns}_fragment_staleness",
            "Global versions published since this learner's anchor",
            ["learner_id", "fragment"],
            registry=registry,
        )
        self.merged_tokens = Counter(
            f"{ns}_merged_tokens",
            "Own tokens confirmed merged (averaged over fragments)",
            ["learner_id"],
            registry=registry,
        ).labels(**lbl)
        self.discarded_tokens = Counter(
            f"{ns}_discarded_tokens",
            "Own tokens overwritten before merge (averaged over fragments)",
            ["learner_id"],
            registry=registry,
        ).labels(**lbl)
        incarnation_g = Gauge(
            f"{ns}_incarnation", "Restart count of this learner id", ["learner_id"], registry=registry
        )
        incarnation_g.labels(**lbl).set(incarnation)
        # Info metric (value 1): join on learner_id to break any learner series down by site, e.g.
        # sum by (site) (ddiloco_learner_merged_tokens_total * on(learner_id) group_left(site) ddiloco_learner_site)
        Gauge(
            f"{ns}_site", "Where this learner runs (--site)", ["learner_id", "site"], registry=registry
        ).labels(learner_id=str(learner_id), site=site).set(1)
        self.site = site
        self.learner_id = str(learner_id)


class _SyncerCollector(Collector):
    def __init__(self, state: Callable[[], dict[str, Any]]) -> None:
        self.state = state

    def collect(self) -> Iterable[Any]:
        s = self.state()
        merged = CounterMetricFamily(
            "ddiloco_syncer_tokens_merged", "Tokens merged into the global model (averaged over fragments)"
        )
        merged.add_metric([], s["tokens_merged"])
        yield merged
        discarded = CounterMetricFamily(
            "ddiloco_syncer_tokens_discarded",
            "Tokens overwritten or lost before merge (from learner reports)",
        )
        discarded.add_metric([], s["tokens_discarded"])
        yield discarded
        budget = GaugeMetricFamily("ddiloco_syncer_token_budget", "Token budget of the run")
        budget.add_metric([], s["token_budget"])
        yield budget
        live = GaugeMetricFamily("ddiloco_syncer_live_learners", "Learners with a fresh heartbeat")
        live.add_metric([], s["live_learners"])
        yield live
        goodput = GaugeMetricFamily(
            "ddiloco_syncer_goodput",
            "Learner time spent training / provisioned learner time so far (the paper's goodput: time lost "
            "to kills, restarts, rejoins and stalls is the rest)",
        )
        goodput.add_metric([], s["goodput"])
        yield goodput
        share = GaugeMetricFamily(
            "ddiloco_syncer_merged_token_share",
            "Tokens merged / tokens processed by learners so far (overlap steps overwritten by a newer "
            "global version and late answers are the rest)",
        )
        share.add_metric([], s["merged_token_share"])
        yield share
        lag = GaugeMetricFamily(
            "ddiloco_syncer_lag",
            "How much less often than every H learner steps fragments are synced (mean sync period / H - 1, "
            "at least 0; `ddiloco.syncer.pace`); absent before two versions of a fragment were published",
        )
        if s.get("syncer_lag") is not None:
            lag.add_metric([], s["syncer_lag"])
        yield lag
        version = GaugeMetricFamily(
            "ddiloco_syncer_global_version", "Latest global version per fragment", labels=["fragment"]
        )
        for p, v in enumerate(s["versions"]):
            version.add_metric([str(p)], v)
        yield version
        quarantined = CounterMetricFamily(
            "ddiloco_syncer_quarantined_objects",
            "Objects at global version keys that did not verify, moved aside, by reason",
            labels=["reason"],
        )
        for reason, n in sorted(s.get("quarantined", {}).items()):
            quarantined.add_metric([reason], n)
        yield quarantined


class SyncerMetrics:
    def __init__(self, registry: CollectorRegistry, state: Callable[[], dict[str, Any]]) -> None:
        ns = "ddiloco_syncer"
        self.rounds = Counter(f"{ns}_rounds", "Rounds closed, by outcome", ["outcome"], registry=registry)
        self.merges = Counter(f"{ns}_merges", "Merges per fragment", ["fragment"], registry=registry)
        self.quorum = Histogram(
            f"{ns}_quorum_size", "Answers merged per round", registry=registry, buckets=QUORUM_BUCKETS
        )
        self.grace = Histogram(
            f"{ns}_grace_wait_seconds",
            "Grace window waited after quorum",
            registry=registry,
            buckets=SECONDS_BUCKETS,
        )
        self.time_to_quorum = Histogram(
            f"{ns}_time_to_quorum_seconds",
            "Round open to K answers",
            registry=registry,
            buckets=SECONDS_BUCKETS,
        )
        self.merge_seconds = Histogram(
            f"{ns}_merge_seconds",
            "Merge + publish time per round",
            registry=registry,
            buckets=SECONDS_BUCKETS,
        )
        self.overlap_steps = Histogram(
            f"{ns}_overlap_steps",
            "Learner steps from a round's opening to its version being published (the paper's tau)",
            registry=registry,
            buckets=STEPS_BUCKETS,
        )
        self.sync_period_steps = Histogram(
            f"{ns}_sync_period_steps",
            "Learner steps between two published versions of a fragment (H when the syncer keeps up)",
            registry=registry,
            buckets=STEPS_BUCKETS,
        )
        self.staleness = Histogram(
            f"{ns}_answer_staleness",
            "Versions between an answer's base and the merge",
            registry=registry,
            buckets=(0, 1, 2, 3, 5, 8, 13),
        )
        self.rejected = Counter(
            f"{ns}_rejected_updates", "Updates rejected, by reason", ["reason"], registry=registry
        )
        self.clipped = Counter(
            f"{ns}_clipped_updates",
            "Answers scaled down by robust mode, by reason",
            ["reason"],
            registry=registry,
        )
        self.outer_grad_norm = Gauge(
            f"{ns}_outer_gradient_norm",
            "L2 norm of the merged outer gradient",
            ["fragment"],
            registry=registry,
        )
        self.published = Counter(
            f"{ns}_published_bytes", "Bytes of global fragments published", registry=registry
        )
        self.report_fields_ignored = Counter(  # unsigned learner reports: NaN, inf, negative, absurd
            f"{ns}_report_fields_ignored",
            "Numbers in learner reports ignored as unusable, by field",
            ["field"],
            registry=registry,
        )
        registry.register(_SyncerCollector(state))


class TrackingMetrics:
    """Experiment tracking (`ddiloco.tracking`) of any role: what its backends could not take."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.dropped = Counter(
            "ddiloco_tracking_dropped_events",
            "Tracking events (TensorBoard, MLflow) dropped because the backend was down or slow, by backend",
            ["backend"],
            registry=registry,
        )
        for backend in TRACKING_BACKENDS:  # exported from 0, so that an alert on any increase sees the first
            self.dropped.labels(backend=backend)


TRACKING_BACKENDS = ("tensorboard", "mlflow")
METRIC_NAMES = frozenset(
    [
        f"ddiloco_learner_{n}_total"
        for n in (
            "inner_steps",
            "tokens",
            "rounds_answered",
            "uploaded_bytes",
            "downloaded_bytes",
            "upload_failures",
            "io_errors",
            "merged_tokens",
            "discarded_tokens",
            "data_wait_seconds",
            "step_seconds",
        )
    ]
    + [
        f"ddiloco_learner_{n}"
        for n in (
            "loss",
            "learning_rate",
            "tokens_per_second",
            "store_retries",
            "fragment_staleness",
            "incarnation",
            "site",
            "mfu",
            "peak_flops",
            "peak_memory_bytes",
        )
    ]
    + [
        f"ddiloco_syncer_{n}_total"
        for n in (
            "rounds",
            "merges",
            "rejected_updates",
            "published_bytes",
            "tokens_merged",
            "tokens_discarded",
        )
    ]
    + [
        f"ddiloco_syncer_{n}"
        for n in (
            "token_budget",
            "live_learners",
            "goodput",
            "merged_token_share",
            "lag",
            "global_version",
            "outer_gradient_norm",
        )
    ]
    + [
        f"ddiloco_syncer_{h}_{s}"
        for h in (
            "quorum_size",
            "grace_wait_seconds",
            "time_to_quorum_seconds",
            "merge_seconds",
            "overlap_steps",
            "sync_period_steps",
            "answer_staleness",
        )
        for s in ("bucket", "sum", "count")
    ]
    + ["ddiloco_syncer_clipped_updates_total", "ddiloco_learner_rejected_total", "up"]
    + ["ddiloco_tracking_dropped_events_total"]
)


def serve(registry: CollectorRegistry, port: int | None, host: str = "0.0.0.0") -> int | None:
    """Serve /metrics on host:port (None: off). Returns the bound port, or None when the port cannot be bound:
    metrics are never worth a training process (a port taken by another program would otherwise fail every
    restart of the role the same way); the error is logged with what to change."""
    if port is None:
        return None
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        log.error(
            "metrics: cannot serve /metrics on %s:%d (%s); training goes on without it. Free the port or pass "
            "another --metrics-port",
            host,
            port,
            e,
        )
        return None
    bound = server.server_address[1]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


def push(
    registry: CollectorRegistry, gateway: str | None, job: str, grouping: dict[str, str] | None = None
) -> None:
    """Push a short-lived task's metrics to a Pushgateway, if one is configured; never fails the task."""
    if not gateway:
        return
    try:
        push_to_gateway(gateway, job=job, registry=registry, grouping_key=grouping or {}, timeout=10)
    except OSError as e:
        log.warning("could not push metrics to %s (%s); the task itself succeeded", gateway, e)


def push_task_metrics(gateway: str | None, task: str, run_id: str, values: dict[str, float]) -> None:
    """For short-lived tasks (prepare, evaluate, sft): one gauge per value, pushed under job=ddiloco_{task}."""
    if not gateway:
        return
    registry = CollectorRegistry()
    for name, value in values.items():
        Gauge(f"ddiloco_{task}_{name}", f"{task}: {name}", ["run_id"], registry=registry).labels(
            run_id=run_id
        ).set(value)
    push(registry, gateway, f"ddiloco_{task}", {"run_id": run_id})
