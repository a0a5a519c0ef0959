"""`ddiloco simulate goodput|bandwidth` end to end through argparse, with a summary.json written here."""

import argparse
import json

import pytest

from ddiloco.cli import simulate as cli

FAST = ["--horizon", "3d"]


def run_json(capsys, argv):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object, nothing else on stdout


@pytest.fixture
def summary(tmp_path):
    s = {
        "run_id": "r1",
        "learners": 4,
        "num_fragments": 3,
        "sync_every": 6,
        "overlap": 2,
        "codec": "int4",
        "model_params": 1000,
        "fragment_bytes": [1600, 1400, 1000],
        "learner_step_seconds": 0.25,
        "bytes_uploaded": 2_000_000,
        "wall_seconds": 100.0,
        "goodput": 0.91,
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(s))
    return path, s


def test_goodput_json_has_the_documented_rows(capsys):
    out = run_json(capsys, ["goodput", "--json", "--chips", "150k", "1.2M", "--learners", "2", "8", *FAST])
    assert out["command"] == "goodput"
    rows = out["rows"]
    assert len(rows) == 2 * 4
    assert {r["method"] for r in rows} == {"dp", "elastic_dp", "decoupled"}
    assert {r["chips"] for r in rows} == {150_000, 1_200_000}
    for r in rows:
        assert set(r) >= {"method", "learners", "chips", "goodput", "uptime"}
        assert 0 <= r["goodput"] <= r["uptime"] <= 1
    cell = next(r for r in rows if (r["method"], r["learners"], r["chips"]) == ("decoupled", 8, 1_200_000))
    assert cell["paper"] == 0.88


def test_goodput_is_reproducible_from_the_command_line(capsys):
    argv = [
        "goodput",
        "--json",
        "--chips",
        "300k",
        "--learners",
        "4",
        "--seed",
        "3",
        "--repair",
        "exp:80",
        *FAST,
    ]
    assert run_json(capsys, argv)["rows"] == run_json(capsys, argv)["rows"]


def test_goodput_table_shows_the_paper_next_to_each_cell(capsys):
    assert cli.main(["simulate", "goodput", "--chips", "1.2M", "--learners", "8", *FAST]) == 0
    out = capsys.readouterr().out
    for text in ("data-parallel", "elastic DP", "decoupled M=8", "(27)", "(58)", "(88)", "uptime %"):
        assert text in out


def test_goodput_plot_writes_a_png(tmp_path, capsys):
    path = tmp_path / "plots" / "goodput.png"
    assert (
        cli.main(["goodput", "--chips", "150k", "300k", "--learners", "2", "--plot", str(path), *FAST]) == 0
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_calibrate_reports_the_fit(capsys):
    out = run_json(capsys, ["goodput", "--json", "--calibrate", "--chips", "150k", "--learners", "2", *FAST])
    assert out["calibration"]["repair_seconds"] == pytest.approx(78.5)
    assert out["params"]["repair"] == "const:78.5"


def test_goodput_from_summary_extrapolates_the_run(summary, capsys):
    path, s = summary
    out = run_json(capsys, ["goodput", "--json", "--chips", "150k", "--from-summary", str(path), *FAST])
    assert {r["learners"] for r in out["rows"] if r["method"] == "decoupled"} == {4}
    assert out["params"]["step_seconds"] == 0.25
    assert out["from_summary"]["goodput"] == 0.91


def test_missing_summary_field_is_named(tmp_path, capsys):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"learners": 2}))
    assert cli.main(["goodput", "--from-summary", str(path), *FAST]) == 2
    assert "learner_step_seconds" in capsys.readouterr().err
    assert cli.main(["bandwidth", "--from-summary", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model_params" in err and "fragment_bytes" in err
    assert cli.main(["bandwidth", "--from-summary", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_bandwidth_json_reproduces_the_paper_setting(capsys):
    out = run_json(capsys, ["bandwidth", "--json"])
    rows = {(r["method"], r["sites"], r["dtype"]): r for r in out["rows"]}
    assert round(rows[("dp", 2, "bf16")]["gbps"]) == 104 and rows[("dp", 2, "bf16")]["paper"] == 104
    assert round(rows[("dp", 8, "bf16")]["gbps"]) == 198
    assert round(rows[("decoupled", 2, "int4")]["gbps_deadline"], 2) == 0.43


def test_bandwidth_table(capsys):
    assert cli.main(["bandwidth", "--params", "5B", "--sites", "2", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "deadline" in out and "0.432" in out and "104" in out


def test_bandwidth_from_summary_uses_measured_fragments(summary, capsys):
    path, s = summary
    out = run_json(capsys, ["bandwidth", "--json", "--from-summary", str(path), "--latency-ms", "0"])
    assert out["params"]["params"] == 1000 and out["params"]["fragments"] == 3
    rows = out["rows"]
    assert {r["sites"] for r in rows} == {4}  # a site per learner
    dec = next(r for r in rows if r["method"] == "decoupled")
    assert dec["dtype"] == "int4"
    bits = 4 + 32 / 128  # this package's codec stores one fp32 scale per 128 values
    f = 2 * 3 / 4
    assert dec["gbps_deadline"] == pytest.approx(1600 / 4 * bits * f / (2 * 0.25) / 1e9, rel=1e-4)
    measured = out["from_summary"]
    assert measured["measured_upload_gbps_per_learner"] == pytest.approx(
        8 * 2_000_000 / 100 / 4 / 1e9, rel=1e-4
    )
    assert measured["predicted_upload_gbps_per_learner"] == pytest.approx(
        1000 * bits / (6 * 0.25) / 1e9, rel=1e-4
    )
    # An explicit flag wins over the summary.
    out = run_json(
        capsys, ["bandwidth", "--json", "--from-summary", str(path), "--sites", "2", "--dtype", "bf16"]
    )
    assert {(r["sites"], r["dtype"]) for r in out["rows"]} == {(2, "bf16")}


def test_bad_arguments_exit_with_usage_errors(capsys):
    for argv in (
        ["goodput", "--repair", "weibull:2"],
        ["goodput", "--chips", "lots"],
        ["bandwidth", "--dtype", "fp8"],
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    assert cli.main(["goodput", "--chips", "150k", "--learners", "64", *FAST]) == 2
    assert "at least one" in capsys.readouterr().err


def test_argument_types():
    assert cli.chips("1.2M") == 1_200_000 and cli.chips("150k") == 150_000 and cli.chips("2.4e6") == 2_400_000
    assert cli.count("5B") == 5e9 and cli.count("5e9") == 5e9
    assert cli.duration("30d") == 30 * 86400 and cli.duration("90m") == 5400 and cli.duration("10") == 10


def test_register_adds_simulate_to_a_top_level_parser():
    parser = argparse.ArgumentParser(prog="ddiloco")
    parser.add_argument("--debug", action="store_true")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["--debug", "simulate", "goodput", "--json", "--chips", "150k"])
    assert args.func is cli.run_goodput and args.json and args.chips == [150_000]
    args = parser.parse_args(["simulate", "bandwidth", "--sites", "8"])
    assert args.func is cli.run_bandwidth and args.sites == [8]
