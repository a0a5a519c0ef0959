"""`benchmarks/syncer_scale.py` at the tiny preset, two rounds: it runs the syncer's path and prints its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "model_bytes",
    "peak_rss_bytes",
    "round_seconds",
    "merge_gbps",
    "memcpy_gbps",
    "threads",
    "learners",
    "fragment_bytes_max_over_ideal",
}


def test_syncer_scale_tiny_prints_its_json_with_the_first_round_apart() -> None:
    args = ["--preset", "tiny", "--fragments", "12", "--learners", "3", "--rounds", "2", "--store", "file"]
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
    assert out["learners"] == 3 and out["threads"] == 1 and out["rounds"] == 2
    assert out["steady_rounds"] == 1  # the first round (fresh memory) is reported apart from the medians
    assert out["per_round"][1]["seconds"] == out["round_seconds"]
    assert out["first_round"]["seconds"] == out["per_round"][0]["seconds"]
    assert out["first_round"]["merge_gbps"] > 0 and out["memcpy_block_gbps"] > 0
    assert out["layout"] == "row_pieces" and out["pieces"] > 0  # tiny at P = 12 splits its large tensors
    assert 1 <= out["fragment_bytes_max_over_ideal"] <= 4 / 3
    assert out["round_seconds"] > 0 and out["merge_gbps"] > 0 and out["memcpy_gbps"] > 0
    assert out["model_bytes"] == 4 * 139_840 and out["peak_rss_bytes"] > 0
