"""Session fixtures for the post-training and report tests: two real tiny runs, one of them post-trained."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddiloco import keys
from ddiloco.posttrain.evaluate import EvalTasksConfig
from ddiloco.posttrain.sft import SFTConfig
from ddiloco.protocol import signing
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store
from ddiloco.store.url import open_store

# Long enough that the tiny model has learned something (val loss ~1.3), short enough for ~15 s per run.
RUN_OVERRIDES = ("diloco.token_budget=150000", "model.seq_len=64")
TEST_EVAL = EvalTasksConfig(items_per_task=16, curve_points=4)
TEST_SFT = SFTConfig(steps=200, lr=3e-3, batch_size=16, items_per_kind=100, eval_items=40)


@dataclass(slots=True)
class PosttrainedRuns:
    root: Path
    k1: Store
    """K = 1 of M = 2, post-trained (evaluate -> SFT -> evaluate), summary.json updated, report written."""
    km: Store
    """K = M = 2, training only."""
    roots: dict[str, RunRoot]
    """"k1" / "km" as RunRoots holding their run key (`ddiloco run` keeps it in {workdir}/{run_id}.key)."""
    fields: dict[str, Any]
    """What posttrain() returned for k1."""
    report: dict[str, Any]
    """What write_reports(k1, root / "report-k1") returned."""


@pytest.fixture(scope="session")
def posttrained_runs(tmp_path_factory: pytest.TempPathFactory) -> PosttrainedRuns:
    from ddiloco.launch import LocalRun
    from ddiloco.posttrain.report import write_reports
    from ddiloco.posttrain.stages import posttrain
    from tests._harness import tiny_config

    root = tmp_path_factory.mktemp("posttrain")
    for run_id, extra in (("k1", ()), ("km", ("diloco.quorum=2", "diloco.token_budget=40000"))):
        LocalRun(tiny_config(run_id, *RUN_OVERRIDES, *extra), root).run(timeout=240)
    k1, km = open_store(str(root / "k1")), open_store(str(root / "km"))
    roots = {
        name: RunRoot.open(store, signing.parse_key((root / f"{name}.key").read_text()), role="test")
        for name, store in (("k1", k1), ("km", km))
    }
    fields = posttrain(roots["k1"], eval_cfg=TEST_EVAL, sft_cfg=TEST_SFT)
    k1.put_json(
        keys.SUMMARY, {**k1.get_json(keys.SUMMARY), **fields}
    )  # what `ddiloco run` does after training
    report = write_reports(k1, root / "report-k1", curve_points=TEST_EVAL.curve_points)
    return PosttrainedRuns(root=root, k1=k1, km=km, roots=roots, fields=fields, report=report)
