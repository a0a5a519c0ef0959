"""Every error a user can fix is one line on stderr that says what to do, exit code 2, no traceback
(unless --debug). Cheap commands only: `prepare` and the roles fail before doing any work."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
SCRUB = ("DDILOCO_S3_", "AWS_", "MINIO_", "S3_ENDPOINT", "DDILOCO_RUN_KEY", "DDILOCO_PUSHGATEWAY")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    return subprocess.Popen(
        [sys.executable, "-m", "ddiloco.cli", *args],
        cwd=ROOT,
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: dict[str, subprocess.Popen[str]]) -> dict[str, Result]:
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        out[name] = Result(proc.returncode, stdout, stderr)
    return out


def one_error_line(r: Result) -> str:
    """The single non-log line on stderr, which must start with `error:`; nothing on stdout."""
    assert "Traceback" not in r.stderr, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout)
    return lines[0]


# name -> (argv, extra env, what the line must say); {tmp} is a fresh directory. A few run as their own
# `python -m ddiloco.cli` processes; the others go through `ddiloco.cli.main.main(argv)` one after the other in
# one more fresh interpreter (the same code from argv to exit code; an interpreter start costs seconds of
# torch import, on two shared cores).
PROCESS_CASES: dict[str, tuple[list[str], dict[str, str], str]] = {
    "unknown-recipe": (["prepare", "--store", "file://{tmp}/a", "--recipe", "nope"], {}, r"'nope'.*tiny-cpu"),
    "missing-corpus": (["prepare", "--store", "file://{tmp}/a", "--set", "data.source=/nonexistent/corpus.txt"], {},
                       r"corpus '/nonexistent/corpus.txt' does not exist"),
}  # fmt: skip
MAIN_CASES: dict[str, tuple[list[str], dict[str, str], str]] = {
    "bad-key": (["prepare", "--store", "file://{tmp}/a", "--set", "diloco.quorm=2"], {},
                r"unknown config key 'diloco.quorm'; did you mean 'diloco.quorum'"),
    "no-endpoint": (["prepare", "--store", "s3://bucket/run"], {}, r"no S3 endpoint configured: set DDILOCO_S3_ENDPOINT"),
    "no-credentials": (["prepare", "--store", "s3://bucket/run"], {"DDILOCO_S3_ENDPOINT": "127.0.0.1:1"},
                       r"no S3 credentials configured: set"),
    "bad-value": (["prepare", "--store", "file://{tmp}/a", "--set", "diloco.quorum=two"], {},
                  r"diloco.quorum='two' must be an integer"),
    "bad-override": (["prepare", "--store", "file://{tmp}/a", "--set", "diloco.quorum"], {},
                     r"must look like section.key=value"),
    "missing-option": (["learner", "--store", "file://{tmp}/a"], {}, r"--store needs --learner-id; use --join URL"),
    "missing-config": (["prepare", "--store", "file://{tmp}/a", "--config", "/nonexistent/run.yaml"], {},
                       r"config file '/nonexistent/run.yaml' not found"),
    "bad-yaml": (["prepare", "--store", "file://{tmp}/a", "--config", "{tmp}/bad.yaml"], {}, r"is not valid YAML"),
    "empty-corpus": (["prepare", "--store", "file://{tmp}/b", "--set", "data.source={tmp}/empty"], {}, r"holds no"),
    "binary-corpus": (["prepare", "--store", "file://{tmp}/b", "--set", "data.source={tmp}/corpus.txt"], {},
                      r"not UTF-8 text.*convert it or remove it"),
    "bad-scheme": (["prepare", "--store", "ftp://host/run"], {}, r"unsupported store URL scheme 'ftp'"),
    "relative-file-url": (["prepare", "--store", "file://relative/run"], {}, r"file:///abs/dir"),
    "unprepared": (["learner", "--store", "file://{tmp}/nothing", "--learner-id", "0"], {}, r"run `ddiloco prepare"),
    "bad-run-key": (["prepare", "--store", "file://{tmp}/c"], {"DDILOCO_RUN_KEY": "not-hex"},
                    r"DDILOCO_RUN_KEY.*openssl rand -hex 32"),
    "cuda-without-gpu": (["run", "--workdir", "{tmp}/e", "--set", "train.device=cuda"], {"CUDA_VISIBLE_DEVICES": ""},
                         r"train.device=cuda but no GPU is visible.*use train.device=auto or cpu"),
}  # fmt: skip
DRIVER = """
import contextlib, io, json, os, sys
from ddiloco.cli.main import main
results = {}
for name, argv, env in json.load(sys.stdin):
    saved = dict(os.environ)
    os.environ.update(env)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    os.environ.clear()
    os.environ.update(saved)
    results[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "empty").mkdir()
    (tmp / "corpus.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp / "bad.yaml").write_text("diloco:\n  quorum: [1,\n")

    def argv(args: list[str]) -> list[str]:
        return [a.replace("{tmp}", str(tmp)) for a in args]

    procs = {name: start(*argv(args), env=env) for name, (args, env, _) in PROCESS_CASES.items()}
    procs["debug"] = start("--debug", "prepare", "--store", f"file://{tmp}/d", "--set", "diloco.quorm=2")
    out = run_main([[name, argv(args), env] for name, (args, env, _) in MAIN_CASES.items()])
    out.update(finish(procs))
    return out


@pytest.mark.parametrize("name", [*PROCESS_CASES, *MAIN_CASES])
def test_user_errors_are_one_line_that_says_what_to_do(results, name):
    says = {**PROCESS_CASES, **MAIN_CASES}[name][2]
    assert re.search(says, one_error_line(results[name]))


def test_debug_shows_the_traceback(results):
    r = results["debug"]
    assert r.returncode != 0 and "Traceback" in r.stderr and "ConfigError" in r.stderr


def run_main(cases: list[list]) -> dict[str, Result]:
    """Run `ddiloco.cli.main.main(argv)` for each [name, argv, env] in one fresh interpreter."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    driver = subprocess.run(
        [sys.executable, "-c", DRIVER], cwd=ROOT, env=base, text=True, input=json.dumps(cases),
        capture_output=True, timeout=300,
    )  # fmt: skip
    assert driver.returncode == 0, driver.stderr
    return {name: Result(*r) for name, r in json.loads(driver.stdout.splitlines()[-1]).items()}


@pytest.mark.s3
def test_missing_bucket_and_refused_credentials(s3_server):
    wrong = {**s3_server.env(), "DDILOCO_S3_SECRET_KEY": "not-the-secret"}
    r = run_main(
        [
            ["bucket", ["prepare", "--store", "s3://no-such-bucket/run"], s3_server.env()],
            ["auth", ["prepare", "--store", s3_server.url("cli-errors/run")], wrong],
        ]
    )
    line = one_error_line(r["bucket"])
    assert "bucket 'no-such-bucket' does not exist" in line and "create it" in line
    line = one_error_line(r["auth"])
    assert "refused" in line and "DDILOCO_S3_SECRET_KEY" in line
