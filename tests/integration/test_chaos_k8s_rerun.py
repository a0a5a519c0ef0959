"""A re-run chaos step (Argo's pod retry, or the stock retryStrategy re-running the DAG) fires no past
event: real `ddiloco chaos` processes against the Kubernetes API stand-in of tests/unit/test_chaos_k8s.py."""

from __future__ import annotations

import subprocess
import sys
import time

from ddiloco import keys
from ddiloco.config.run import ChaosConfig, RunConfig
from ddiloco.store.url import open_store
from tests.unit.test_chaos_k8s import NS, KubeAPIStandIn, _pod, report, two_runs


def test_a_rerun_chaos_step_fires_no_past_event(tmp_path):
    """Real processes on a file store: the first chaos step fires k0 and is SIGKILLed before k1 is due;
    the re-run (Argo's pod retry, or the stock retryStrategy re-running the DAG) starts after k1's time and
    fires nothing: k0 is recorded, k1 was missed and is recorded as such instead of fired late."""
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    cfg = RunConfig()
    cfg.run_id = "run"
    events_ = [
        {"id": "k0", "kind": "kill_learner", "learner": 0, "at_s": 0},
        {"id": "k1", "kind": "kill_learner", "learner": 1, "at_s": 60},
        {"id": "k2", "kind": "kill_learner", "learner": 1, "at_s": 3600},  # not due: the re-run keeps it
    ]
    cfg.chaos = ChaosConfig(events=events_)
    store.put_json(keys.CONFIG, cfg.to_dict())
    t0 = time.time()
    store.put_json(keys.DATA_META, {"prepared_at": t0})
    report(store, 0, 0, "wf-a-learner-0")
    report(store, 1, 0, "wf-a-learner-1")
    with KubeAPIStandIn(two_runs()) as api:
        argv = [sys.executable, "-m", "ddiloco.cli", "chaos", "--store", url, "--namespace", NS, "--workflow",
                "wf-a", "--kube-api", api.url, "--poll-seconds", "0.05", "--victim-wait", "0.5"]  # fmt: skip
        first = subprocess.Popen(argv)
        try:
            while not store.exists(keys.chaos_record_key("k8s", "k0")):
                assert first.poll() is None and time.time() < t0 + 50, "k0 not fired before k1 was due"
                time.sleep(0.05)
        finally:
            first.kill()
            first.wait()
        assert api.deletes() == ["wf-a-learner-0"]
        api.pods["wf-a-learner-0"] = _pod("wf-a-learner-0", "wf-a", "learner")  # Argo's retry of the pod
        store.put_json(keys.DATA_META, {"prepared_at": t0 - 100})  # time passes: k1 is past due at the re-run
        again = subprocess.Popen(argv)
        try:
            while not store.exists(keys.chaos_record_key("k8s", "k1")):
                assert again.poll() is None, "the re-run ended without recording k1"
                time.sleep(0.05)
            store.put_json(keys.DONE, {"done": True})
            assert again.wait(timeout=30) == 0
        finally:
            again.kill()
        assert api.deletes() == ["wf-a-learner-0"], "the re-run fired a past event"
    k1 = store.get_json(keys.chaos_record_key("k8s", "k1"))
    assert k1["action"].startswith("skipped (missed: due at 60s"), k1
    assert not store.exists(keys.chaos_record_key("k8s", "k2"))
    assert len(store.get_json(keys.chaos_step_key("k8s"))["started_at"]) == 2
