"""The same end-to-end run with the store on a real S3 server (SeaweedFS on loopback)."""

import pytest

from ddiloco.launch import LocalRun
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = [pytest.mark.s3, pytest.mark.slow]


def test_local_run_over_s3(s3_server, tmp_path):
    cfg = tiny_config("s3e2e", "diloco.token_budget=16000")
    run = LocalRun(cfg, tmp_path, store_root=s3_server.url("runs"), extra_env=s3_server.env())
    s = run.run(timeout=600)
    assert run.url.startswith("s3://")
    assert s["status"] == "done" and s["ledger_balanced"] and s["global_versions_contiguous"]
    assert s["final_val_loss"] < s["initial_val_loss"]
    store = open_store(run.url, env=s3_server.env())
    assert store.get_json("summary.json")["run_id"] == "s3e2e"
    assert store.exists("final/model.safetensors") and store.exists("done.json")
    assert not list((tmp_path).glob("s3e2e/*")), "nothing of the run lands on local disk but logs"
