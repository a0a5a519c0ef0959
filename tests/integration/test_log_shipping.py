"""Log shipping with real processes and real signals: a SIGKILLed learner leaves its log up to its last
shipping interval in the store, a SIGTERMed one all of it; `ddiloco logs` prints them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from ddiloco import keys
from ddiloco.cli.main import main
from ddiloco.posttrain.summary import read_reports
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.tracking import logship
from tests._harness import tiny_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = 0.5
SLACK = 1.0  # the shipping thread on two busy cores: a write may land this late
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")


def start_learner(url: str, lid: int, err: Path, interval: float) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", logship.ENV_INTERVAL: str(interval)}
    with open(err, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", "learner", "--store", url, "--learner-id", str(lid)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=f,
        )  # fmt: skip


def log_lines(text: str) -> list[tuple[float, str]]:
    """(epoch seconds, line) of each log line (asctime is local time, as time.time() is)."""
    out = []
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if m:
            out.append((datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp(), line))
    return out


def wait_for(proc: subprocess.Popen, err: Path, text: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in err.read_text():
        assert proc.poll() is None, f"learner exited ({proc.returncode}):\n{err.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout}s:\n{err.read_text()[-3000:]}"
        time.sleep(0.1)


def shipped(url: str, lid: int, capsys) -> tuple[str, list[str]]:
    """`ddiloco logs --store URL --role learner --id LID`: (header, log lines)."""
    assert main(["logs", "--store", url, "--role", "learner", "--id", str(lid)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    return header, [line for line in lines if LOG_LINE.match(line)]


def test_killed_and_terminated_learners_leave_their_logs(tmp_path, capsys):
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    prepare(store, tiny_config("logship", "diloco.token_budget=100000000"))
    errs = [tmp_path / "learner-0.err", tmp_path / "learner-1.err"]
    # learner 0 ships every INTERVAL and is SIGKILLed; learner 1 ships once when it knows its incarnation,
    # then only every minute: what else the store holds of it after SIGTERM, the SIGTERM handler wrote.
    procs = [start_learner(url, 0, errs[0], INTERVAL), start_learner(url, 1, errs[1], 60)]
    try:
        for proc, err in zip(procs, errs, strict=True):
            wait_for(proc, err, "joined run")
        time.sleep(INTERVAL + 2 * SLACK)
        before = logship.read_log(store, keys.log_key("learner", 0, 1))
        assert before["exit"] is None and not any("SIGTERM" in line for line in before["lines"])
        killed_at = time.time()
        procs[0].send_signal(signal.SIGKILL)
        procs[1].send_signal(signal.SIGTERM)
        assert procs[0].wait(30) == -signal.SIGKILL
        assert procs[1].wait(30) == -signal.SIGTERM, "it still dies of SIGTERM, after shipping"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    # SIGKILL: every line logged up to one interval before the kill is there, and nothing else
    header, lines = shipped(url, 0, capsys)
    assert header.startswith("==> logs/learner/000-0000.json: learner 0 incarnation 0, pid")
    assert header.endswith("running, or killed <==")
    logged = log_lines(errs[0].read_text())
    due = [line for t, line in logged if t <= killed_at - INTERVAL - SLACK]
    assert any("joined run" in line for line in due)
    assert lines[: len(due)] == due and lines == [line for _, line in logged][: len(lines)]

    # SIGTERM: all of it, down to the handler's own last line
    header, lines = shipped(url, 1, capsys)
    assert header.startswith("==> logs/learner/001-0000.json") and header.endswith("SIGTERM <==")
    assert lines == [line for _, line in log_lines(errs[1].read_text())]
    assert any("joined run" in line for line in lines) and "SIGTERM received" in lines[-1]

    # the report's view: neither wrote a final learner report, so both died
    deaths = {d["key"]: d for d in logship.died(store, read_reports(store), done=True)}
    assert deaths["logs/learner/000-0000.json"]["why"] == "killed: no final report"
    assert deaths["logs/learner/001-0000.json"]["why"] == "killed: no final report (SIGTERM)"
