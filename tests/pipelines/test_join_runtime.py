"""The `join` pipeline's runtime: the run check with this cluster's store access, and the joiner's command."""

from __future__ import annotations

import json

import pytest
from ddiloco.components.runtime import command, join_name, join_slots

from ddiloco.cli.main import build_parser


def test_join_slots_need_a_prepared_run_and_a_learner_count_within_the_compiled_cap(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="no run at .*RUN_ID"):
        join_slots(f"file://{run}", 2, 8)
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text(json.dumps({"run_id": "run"}))
    assert join_slots(f"file://{run}", 3, 8) == [0, 1, 2]
    with pytest.raises(ValueError, match="--pipeline join --max-learners"):
        join_slots(f"file://{run}", 9, 8)


def test_the_joiner_command_is_a_learner_the_cli_accepts():
    cmd = command(
        "learner", join="s3://b/p/run", site="eu", join_name=join_name("0a1b-2c", 1), device=None,
        link_bandwidth="10Mbit", link_latency=None, metrics_port=9400,
    )  # fmt: skip
    args = build_parser().parse_args(cmd[3:])
    assert (args.join, args.site, args.join_name, args.link_bandwidth) == (
        "s3://b/p/run",
        "eu",
        "0a1b-2c-1",
        "10Mbit",
    )
    assert args.store is None and args.learner_id is None
