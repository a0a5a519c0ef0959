"""`benchmarks/syncer_scale.py` at the tiny preset, three rounds in flight as the syncer's loop runs them: it runs
the syncer's path (collect, propose, publish on the publisher's thread, commit) and prints its JSON."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "model_bytes",
    "peak_rss_bytes",
    "round_seconds",
    "rounds_per_second",
    "publish_gaps_seconds",
    "merge_gbps",
    "memcpy_gbps",
    "threads",
    "learners",
    "fragment_bytes_max_over_ideal",
}


def test_syncer_scale_tiny_prints_its_json_with_the_first_round_apart() -> None:
    args = ["--preset", "tiny", "--fragments", "12", "--learners", "3", "--rounds", "3", "--store", "file"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/syncer_scale.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert KEYS <= out.keys()
    assert out["learners"] == 3 and out["threads"] == 1 and out["rounds"] == 3
    assert out["mode"] == "pipelined" and out["depth"] >= 1
    assert out["steady_rounds"] == 2  # the first round (fresh memory) is reported apart from the medians
    assert out["first_round"]["seconds"] == out["per_round"][0]["seconds"]
    assert out["first_round"]["merge_gbps"] > 0
    gaps = out["publish_gaps_seconds"]  # every round was published, in order
    assert len(gaps) == 2 and all(g > 0 for g in gaps)
    assert out["rounds_per_second"] == pytest.approx(1 / gaps[1], rel=1e-3)
    for r in out["per_round"]:  # each round's timeline: collected, handed over, published, then committed
        assert r["publish"] > 0 and r["propose"] > 0
        assert r["collect_start"] <= r["submitted"] <= r["publish_start"] < r["publish_end"] <= r["committed"]
    assert out["layout"] == "row_pieces" and out["pieces"] > 0  # tiny at P = 12 splits its large tensors
    assert 1 <= out["fragment_bytes_max_over_ideal"] <= 4 / 3
    assert out["round_seconds"] > 0 and out["merge_gbps"] > 0
    assert out["memcpy_gbps"] is None and out["cpu_seconds_per_round"] > 0  # no yardstick beside a pipeline
    assert out["server_cpu_seconds_per_round"] is None  # no S3 server with the file store
    by_thread = out["cpu_seconds_per_round_by_thread"]
    assert {"loop", "readers", "publish", "publish_writer", "cleaner", "other"} <= by_thread.keys()
    assert sum(by_thread.values()) == pytest.approx(out["cpu_seconds_per_round"], rel=1e-2)
    assert out["model_bytes"] == 4 * 139_840 and out["peak_rss_bytes"] > 0
