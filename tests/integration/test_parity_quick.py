"""`benchmarks/parity.py --quick` end to end: three real runs (DP over gloo, sync and Decoupled DiLoCo)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.long  # three real runs (43 s): the quality preset (`--preset small`) is checked by hand per change
def test_parity_quick_prints_a_table_and_one_json_object(tmp_path):
    out = tmp_path / "parity.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/parity.py", "--quick", "--task-items", "5", "--json", str(out),
         "--workdir", str(tmp_path / "runs")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text())
    assert "## methods" in proc.stdout and "data-parallel" in proc.stdout

    methods = {e["method"]: e for e in last["methods"]}
    assert set(methods) == {"dp", "sync", "decoupled"}
    for e in methods.values():
        assert {"method", "final_val_loss", "bytes_per_learner", "wall_seconds"} <= e.keys()
        assert e["final_val_loss"] < e["initial_val_loss"]
        assert e["task_accuracy"] is not None
    dp, dec = methods["dp"], methods["decoupled"]
    # Equal tokens processed: DP rounds up to a whole global batch (M × B × T = 2 × 4 × 32).
    assert 0 <= dp["tokens_processed"] - dec["tokens_processed"] < 2 * 4 * 32
    assert dp["bytes_per_learner"] == dp["steps"] * dp["model_params"] * 4 * dp["ring_factor"]
    assert dp["params_identical"]
    assert dec["bytes_x_vs_dp"] > 1 and dec["codec"] == "int4" and dec["ledger_balanced"]
    assert 0 < dec["norm_ratio"] <= 1.0 + 1e-6
    assert not list((tmp_path / "runs").iterdir())  # every run's temporary workdir was removed
    # One seed: the aggregate repeats the run's numbers, with no spread; compute mode is the default.
    assert last["seeds"] == [0] and last["corpus"] == {"name": "synthetic"}
    assert last["compare"]["mode"] == "compute" and dec["seed"] == 0
    assert last["compare"]["dp_tokens_by_seed"] == {"0": dec["tokens_processed"]}
    agg = {a["method"]: a for a in last["aggregate"]["methods"]}
    assert agg["decoupled"]["final_val_loss"] == dec["final_val_loss"] and agg["decoupled"]["n"] == 1
    assert agg["decoupled"]["loss_vs_dp_pct_std"] is None
    assert last["checks"]["decoupled_vs_dp_pct"][""] == dec["loss_vs_dp_pct"]
