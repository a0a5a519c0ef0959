"""The Grafana dashboard is valid JSON and every query names a metric the code exports."""

import json
import re
from pathlib import Path

from ddiloco.tracking.metrics import METRIC_NAMES

DASHBOARD = Path(__file__).resolve().parents[2] / "manifests" / "monitoring" / "dashboards" / "ddiloco.json"
FUNCTIONS = {
    "rate",
    "increase",
    "sum",
    "max",
    "count",
    "histogram_quantile",
    "by",
    "le",
    "on",
    "group_left",
    "site",
}


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\{[^}]*\}", "", expr)  # drop label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # drop range selectors
    expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)  # drop grouping labels
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {
        w
        for w in words
        if w not in FUNCTIONS
        and not w.startswith("learner_id")
        and w not in ("fragment", "reason", "outcome", "kind")
    }


def test_dashboard_queries_only_use_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    used = set().union(*map(_metric_names, exprs))
    assert used <= METRIC_NAMES, sorted(used - METRIC_NAMES)
    for topic in (
        "Progress",
        "throughput",
        "Quorum",
        "Staleness",
        "Failures",
        "Bytes",
        "MFU",
        "memory",
        "wait",
    ):
        assert any(topic.lower() in p["title"].lower() for p in dash["panels"]), topic
    assert {"ddiloco_syncer_goodput", "ddiloco_syncer_merged_token_share"} <= used
    assert {
        "ddiloco_learner_mfu",
        "ddiloco_learner_peak_memory_bytes",
        "ddiloco_learner_data_wait_seconds_total",
    } <= used


def test_every_exported_metric_name_is_real():
    from prometheus_client import CollectorRegistry

    from ddiloco.tracking.metrics import LearnerMetrics, SyncerMetrics, TrackingMetrics

    reg = CollectorRegistry()
    learner = LearnerMetrics(reg, 0, 0)
    state = {
        "tokens_merged": 1,
        "tokens_discarded": 0,
        "token_budget": 2,
        "live_learners": 1,
        "goodput": 0.5,
        "merged_token_share": 0.9,
        "syncer_lag": 0.1,
        "versions": [0],
    }
    syncer = SyncerMetrics(reg, lambda: state)
    TrackingMetrics(reg)
    # Labelled families only expose samples once a child exists, as they do in a running process.
    learner.staleness.labels(learner_id="0", fragment="0").set(0)
    syncer.merges.labels(fragment="0").inc()
    syncer.outer_grad_norm.labels(fragment="0").set(1)
    syncer.rejected.labels(reason="checksum").inc()
    syncer.clipped.labels(reason="norm_outlier").inc()
    learner.rejected.labels(learner_id="0", kind="global", reason="bad_signature").inc()
    learner.mfu.labels(learner_id="0").set(0.4)  # only where the peak is known
    learner.peak_flops.labels(learner_id="0").set(1e12)
    learner.peak_memory.labels(learner_id="0", kind="peak_rss").set(1)
    syncer.rounds.labels(outcome="merged").inc()
    exposed = {s.name for m in reg.collect() for s in m.samples}
    assert METRIC_NAMES - {"up"} <= exposed, sorted(METRIC_NAMES - {"up"} - exposed)
