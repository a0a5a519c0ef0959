"""`benchmarks/parity.py --preset small`: the small-budget check's settings, and that the command line wins."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parity():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import parity as module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def test_the_small_preset_is_three_seeds_of_both_methods_at_a_small_budget(parity):
    args, methods, ablations = parity.parse_args(["--preset", "small"])
    assert methods == ["dp", "decoupled"] and ablations == []
    assert (args.seeds, args.tokens, args.task_items, args.compare) == (3, 2_500_000, 0, "compute")
    assert "diloco.sync_every=48" in args.overrides
    assert "diloco.codec=int4" in parity.DECOUPLED


def test_the_command_line_wins_over_the_preset(parity):
    args, methods, _ = parity.parse_args(
        ["--preset", "small", "--seeds", "1", "--methods", "decoupled", "--set", "diloco.sync_every=32"]
    )
    assert args.seeds == 1 and methods == ["decoupled"]
    assert args.overrides == ["diloco.sync_every=48", "diloco.sync_every=32"]  # --set applied last
    plain, methods, _ = parity.parse_args([])
    assert (plain.seeds, plain.tokens, plain.task_items, plain.overrides) == (1, None, 100, [])
    assert methods == ["dp", "sync", "decoupled"]
    with pytest.raises(SystemExit):
        parity.parse_args(["--preset", "small", "--quick"])


def test_the_summary_line_carries_the_gap_and_its_spread(parity):
    args, _, _ = parity.parse_args(["--preset", "small"])
    agg = {
        "methods": [
            {"method": "dp", "final_val_loss": 1.0, "final_val_loss_std": 0.1},
            {
                "method": "decoupled",
                "final_val_loss": 1.1,
                "final_val_loss_std": 0.05,
                "loss_vs_dp_pct": 10.0,
                "loss_vs_dp_pct_std": 2.0,
                "loss_vs_dp_pct_min": 8.0,
                "loss_vs_dp_pct_max": 12.0,
                "loss_vs_dp_pct_by_seed": {0: 8.0, 1: 10.0, 2: 12.0},
                "tokens_processed": 2.8e6,
            },
        ]
    }
    line = parity.small_budget_line(args, {"aggregate": agg, "seeds": [0, 1, 2], "total_seconds": 700.04})
    gap = line["small_budget"]["gap_vs_dp_pct"]
    assert gap == {"mean": 10.0, "std": 2.0, "min": 8.0, "max": 12.0, "by_seed": {0: 8.0, 1: 10.0, 2: 12.0}}
    assert line["small_budget"]["dp_loss"] == 1.0 and line["small_budget"]["total_seconds"] == 700.0
    assert parity.small_budget_line(args, {"aggregate": {"methods": agg["methods"][:1]}}) is None
