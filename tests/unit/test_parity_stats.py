"""`benchmarks/_parity_stats.py`: gaps to data-parallel per seed, then mean / spread over seeds (no runs)."""

import importlib.util
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_parity_stats", ROOT / "benchmarks" / "_parity_stats.py")
stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stats)


def run(seed: int, loss: float, tokens: int, **extra) -> dict:
    """A finished run as `Runner` returns it (the fields `vs_dp` reads)."""
    return {
        "seed": seed,
        "final_val_loss": loss,
        "tokens_processed": tokens,
        "bytes_per_learner": 1000.0,
        "wall_seconds": 10.0,
        **extra,
    }


def method_rows() -> list[dict]:
    """Two seeds; data-parallel processed the decoupled run's tokens (rounded up) in each."""
    rows = []
    for seed, (dp_loss, dec_loss, tok) in enumerate([(2.0, 2.2, 1000), (1.0, 1.05, 1200)]):
        dp = {"method": "dp", "label": "data-parallel", **run(seed, dp_loss, tok + 8)}
        dec = {"method": "decoupled", "label": "decoupled DiLoCo", **run(seed, dec_loss, tok)}
        for r in (dp, dec):
            stats.vs_dp(r, dp)
        rows += [dp, dec]
    return rows


def test_the_gap_is_taken_per_seed_then_averaged():
    agg = {a["method"]: a for a in stats.aggregate(method_rows(), key="method")}
    dec, dp = agg["decoupled"], agg["dp"]
    assert dec["seeds"] == [0, 1] and dec["n"] == 2 and dec["label"] == "decoupled DiLoCo"
    assert dec["loss_vs_dp_pct_by_seed"] == pytest.approx({0: 10.0, 1: 5.0})
    assert dec["loss_vs_dp_pct"] == pytest.approx(7.5)
    assert dec["loss_vs_dp_pct_std"] == pytest.approx(statistics.stdev([10.0, 5.0]))
    assert (dec["loss_vs_dp_pct_min"], dec["loss_vs_dp_pct_max"]) == pytest.approx((5.0, 10.0))
    # The gap of the mean losses is a different number (seed 0's larger losses weigh more), reported apart.
    assert dec["loss_vs_dp_pct_of_means"] == pytest.approx(100 * (1.625 / 1.5 - 1))
    assert dec["final_val_loss"] == pytest.approx(1.625) and dp["final_val_loss"] == pytest.approx(1.5)
    assert dec["final_val_loss_std"] == pytest.approx(statistics.stdev([2.2, 1.05]))
    assert dp["loss_vs_dp_pct"] == 0 and dp["loss_vs_dp_pct_std"] == 0
    # Equal compute: data-parallel processed the decoupled run's tokens of the same seed.
    assert dec["processed_vs_dp"] == pytest.approx(statistics.fmean([1000 / 1008, 1200 / 1208]))


def test_one_seed_has_no_standard_deviation_and_keeps_the_run_values():
    rows = [r for r in method_rows() if r["seed"] == 1]
    agg = {a["method"]: a for a in stats.aggregate(rows, key="method")}
    assert agg["decoupled"]["loss_vs_dp_pct"] == pytest.approx(5.0)
    assert agg["decoupled"]["loss_vs_dp_pct_std"] is None and agg["decoupled"]["n"] == 1
    assert agg["decoupled"]["final_val_loss"] == 1.05


def test_ablation_rows_aggregate_by_config_against_the_methods_data_parallel():
    dp = stats.aggregate(method_rows(), key="method")[0]
    rows = [
        {
            "config": "outer Nesterov lr 0.7 m 0.9",
            **run(0, 2.2, 1000, loss_vs_dp_pct=10.0, loss_vs_ref_pct=0.0),
        },
        {
            "config": "outer lr 1.0 no momentum",
            **run(0, 2.42, 1000, loss_vs_dp_pct=21.0, loss_vs_ref_pct=10.0),
        },
        {
            "config": "outer Nesterov lr 0.7 m 0.9",
            **run(1, 1.05, 1200, loss_vs_dp_pct=5.0, loss_vs_ref_pct=0.0),
        },
        {"config": "outer lr 1.0 no momentum", **run(1, 1.1, 1200, loss_vs_dp_pct=10.0, loss_vs_ref_pct=4.0)},
    ]
    agg = stats.aggregate(rows, dp=dp)
    assert [a["config"] for a in agg] == ["outer Nesterov lr 0.7 m 0.9", "outer lr 1.0 no momentum"]
    assert agg[1]["loss_vs_ref_pct"] == pytest.approx(7.0) and agg[1]["loss_vs_dp_pct"] == pytest.approx(15.5)
    assert agg[1]["loss_vs_dp_pct_of_means"] == pytest.approx(100 * (1.76 / 1.5 - 1))
    c = stats.checks([], {"outer": agg})
    assert c["outer_plain_vs_nesterov_pct"] == pytest.approx(100 * (1.76 / 1.625 - 1))


def test_a_seed_twice_is_refused():
    rows = [{"config": "x", **run(0, 1.0, 10)}, {"config": "x", **run(0, 1.1, 10)}]
    with pytest.raises(ValueError, match="seed listed twice"):
        stats.aggregate(rows)


def test_checks_read_the_means_and_the_table_prints_the_spread():
    agg = stats.aggregate(method_rows(), key="method")
    for a in agg:
        a["bytes_x_vs_dp"] = 300.0
    c = stats.checks(agg, {})
    assert c["decoupled_vs_dp_pct"][""] == pytest.approx(7.5)
    assert c["decoupled_within_3pct_of_dp"] is False and c["decoupled_bytes_at_least_100x_lower"] is True
    text = stats.table("t", [(a["label"], a) for a in agg], stats.AGGREGATE_COLUMNS)
    assert "± sd" in text and "+7.50" in text and "3.54" in text  # stdev(10, 5) = 3.536
