"""Every `ddiloco` subcommand through the real entry point (the console script in a subprocess), for real at
a tiny size where that needs no cluster; one shared finished run (`tests._cli.cli_run`) keeps it cheap.

A function test calls the code behind a command; only these see what the user sees: the parser, the
output helper, the exit code (`ddiloco summary` crashed in `emit` while every function test passed).
"""

from __future__ import annotations

import json

import pytest

from tests._cli import CliRun, ddiloco

pytestmark = pytest.mark.slow


def test_run_prints_where_its_summary_is(cli_run: CliRun):
    summary = cli_run.root / "summary.json"
    assert cli_run.result.stdout.strip() == str(summary)
    assert json.loads(summary.read_text())["status"] == "done"
    assert "ledger balanced" in cli_run.result.stderr


def test_summary_prints_the_run_summary_as_json(cli_run: CliRun):
    out = ddiloco("summary", "--store", cli_run.url, env=cli_run.env())
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout)
    assert summary["ledger_balanced"] is True and summary["run_id"] == "r"
