"""End to end with real processes: `ddiloco run`'s orchestrator starts a syncer and learner processes."""

import json
import subprocess
import sys

import pytest

from ddiloco import keys
from ddiloco.launch import LocalRun
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = pytest.mark.slow


def test_local_run_with_real_processes(tmp_path):
    cfg = tiny_config("e2e", "diloco.learners=3", "diloco.fragments=3", "diloco.token_budget=60000")
    run = LocalRun(cfg, tmp_path)
    s = run.run(timeout=600)
    assert s.status == "done"
    assert s.ledger_balanced, (
        s.tokens_merged_per_fragment,
        s.tokens_merged_by_learners_per_fragment,
    )
    assert s.tokens_outstanding == 0 and s.tokens_merged >= 60000
    assert s.global_versions_contiguous
    assert s.incarnations == {"0": 1, "1": 1, "2": 1}
    assert s.final_val_loss < s.initial_val_loss
    assert 0.9 <= s.goodput <= 1, s.learner_accounting  # no failures: (almost) no learner time lost
    rss = [a["peak_rss_bytes"] for a in s.learner_accounting.values()]
    assert all(64 << 20 < r < 4 << 30 for r in rss), rss  # each learner process's own peak (torch loaded)
    assert 0 < s.merged_token_share < 1 and s.steps_per_answer > 1
    assert json.loads(open(run.summary_location).read())["run_id"] == "e2e"
    store = open_store(run.url)
    assert not store.list("updates/"), "merged and abandoned rounds are garbage-collected"
    # Issue 16 item 6: bounded storage at the default retention, the store's size in the summary (which
    # the later report files are not part of), and a loss curve drawn from the versions kept.
    assert all(1 <= n <= 16 for n in s.global_versions_kept), s.global_versions_kept
    sizes = store.sizes()
    assert 0 < s.store_bytes <= sum(sizes.values())
    assert s.store_bytes_by_prefix["global/"] == sum(n for k, n in sizes.items() if k.startswith("global/"))
    assert len(store.get_json(keys.EVAL_CURVE)["points"]) >= 2


def test_cli_rejects_bad_config_in_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "run", "--workdir", str(tmp_path), "--set", "diloco.quorom=2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().startswith(
        "error: unknown config key 'diloco.quorom'; did you mean 'diloco.quorum'?"
    )
    assert "Traceback" not in out.stderr
    assert not (tmp_path / keys.DONE).exists()
