"""A real Prometheus server (Debian package `prometheus`, on loopback) scrapes a local run."""

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest

from ddiloco.launch import LocalRun
from tests._harness import tiny_config

pytestmark = [pytest.mark.prometheus, pytest.mark.slow, pytest.mark.long]  # 30 s of real processes
LEARNERS = 3


def _free_block(n: int) -> int:
    for base in range(23000, 60000, 97):
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


def _query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?query={urllib.parse.quote(expr)}"
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)["data"]["result"]


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (apt-get install prometheus); .ci/run installs it")
    base = _free_block(LEARNERS + 2)
    web = base + LEARNERS + 1
    targets = {
        "syncer": [f"127.0.0.1:{base}"],
        "learner": [f"127.0.0.1:{base + 1 + i}" for i in range(LEARNERS)],
    }
    scrape = [
        {
            "job_name": job,
            "scrape_interval": "1s",
            "scrape_timeout": "900ms",
            "static_configs": [{"targets": t}],
        }
        for job, t in targets.items()
    ]
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "1s"}, "scrape_configs": scrape}))
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{web}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/-/ready", timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"prometheus did not start: {(tmp_path / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.3)
    yield url, base
    proc.terminate()
    proc.wait(timeout=15)


def test_prometheus_sees_merged_tokens_grow_and_every_learner_up(prometheus, tmp_path):
    url, base = prometheus
    # 25 s after prepare whatever the machine's speed (a 400k-token budget took 56 s on a loaded one): ~20
    # scrapes at 1 s; the test needs three of the merged counter and one with every learner up.
    timed = ("diloco.token_budget=1000000000", "diloco.deadline_s=25", "sft=null")
    cfg = tiny_config("prom", f"diloco.learners={LEARNERS}", *timed)
    run = LocalRun(cfg, tmp_path, metrics_base_port=base)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run.run(timeout=240)), daemon=True)
    thread.start()
    merged, all_up, max_steps = [], False, 0.0
    while thread.is_alive():
        time.sleep(1.0)
        rows = _query(url, "ddiloco_syncer_tokens_merged_total")
        if rows:
            merged.append(float(rows[0]["value"][1]))
        up = _query(url, 'up{job="learner"}')
        all_up |= len(up) == LEARNERS and all(r["value"][1] == "1" for r in up)
        steps = _query(url, "sum(ddiloco_learner_inner_steps_total)")
        if steps:
            max_steps = max(max_steps, float(steps[0]["value"][1]))
    thread.join()
    assert result["summary"].status == "done"
    assert all_up, "every learner was up at the same scrape"
    assert len(merged) >= 3 and merged == sorted(merged) and merged[-1] > merged[0], merged
    assert max_steps > 0
