"""Cross-region training: a slow link does not slow inner steps, and a second site joins a running run."""

import os
import subprocess
import sys
import threading
import time
import uuid

import pytest

from ddiloco import keys
from ddiloco.launch import LocalRun
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.report_data import flat_metrics, site_rows
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import signing
from ddiloco.run.prepare import prepare
from ddiloco.store.shaped import Link, shape
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer, run_until_done
from tests._harness import drive, tiny_config

SECONDS = 6.0


def _inner_steps_in(seconds: float, link: Link | None):
    """Inner steps one learner makes in `seconds` (after start-up) next to a syncer thread, on a memory store;
    returns (steps, learner, its store)."""
    name = f"xr-{uuid.uuid4().hex[:8]}"
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, "diloco.token_budget=100000000", "diloco.learners=1"))
    syncer = Syncer.open(store)
    thread = threading.Thread(target=run_until_done, args=(syncer, seconds + 20), daemon=True)
    thread.start()
    shaped = shape(store, link)
    learner = Learner.open(shaped, 0)
    learner.start()  # start-up reads (globals, shard) do go over the link, on this thread
    before = shaped.link_stats.snapshot() if link else None
    steps, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        assert learner.tick()
        steps += 1
    after = shaped.link_stats.snapshot() if link else None
    learner.close("max_steps")
    syncer.step = lambda: True  # stop the syncer thread at its next pass
    thread.join(timeout=30)
    return steps, learner, (before, after)


@pytest.mark.long  # 16 s; the shaped link's arithmetic is unit-tested (test_shaped)
def test_a_1mbit_link_does_not_block_inner_steps():
    free, free_learner, _ = _inner_steps_in(SECONDS, None)
    slow, slow_learner, (before, after) = _inner_steps_in(SECONDS, Link.parse("1Mbit", "50ms"))
    # The link really was slow and carried the answers: seconds of shaping, all of it off the main thread.
    assert after["seconds"] - before["seconds"] > 2.0, after
    assert after["main_thread_seconds"] == before["main_thread_seconds"], (before, after)
    assert slow_learner.exchange.rounds_answered >= 2 and slow_learner.exchange.bytes_up > 0
    # Inner steps go on at about the same rate (generous: the machine is shared and noisy).
    assert slow >= 0.5 * free, (slow, free)
    assert free_learner.exchange.rounds_answered >= slow_learner.exchange.rounds_answered


def test_summary_report_and_metrics_break_merged_tokens_down_by_site():
    name = f"xr-sites-{uuid.uuid4().hex[:8]}"
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name))
    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, 0, site="dc1"), Learner.open(store, 1, site="eu-west")]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    s = build_summary(store)
    assert s.learners_by_site == {"dc1": [0], "eu-west": [1]}
    assert set(s.tokens_merged_by_site) == {"dc1", "eu-west"}
    assert sum(s.tokens_merged_by_site.values()) == pytest.approx(s.tokens_merged)
    assert sum(s.tokens_processed_by_site.values()) == s.tokens_processed
    rows = site_rows(s.to_json())  # the report renders summary.json
    assert [r[:2] for r in rows] == [["dc1", "0"], ["eu-west", "1"]]
    assert flat_metrics(s.to_json())["tokens_merged_by_site_eu-west"] == s.tokens_merged_by_site["eu-west"]
    sample = learners[1].registry.get_sample_value(
        "ddiloco_learner_site", {"learner_id": "1", "site": "eu-west"}
    )
    assert sample == 1.0
    reports = [store.get_json(keys.report_key(i, 0)) for i in (0, 1)]
    assert [r["site"] for r in reports] == ["dc1", "eu-west"]


@pytest.mark.slow
@pytest.mark.long  # two sites of real processes (50 s); the link and by-site accounting tests stay in CI
def test_two_sites_both_contribute_merged_tokens(tmp_path):
    """Site a: `ddiloco run`'s learners (LocalRun) over file://; site b: a learner joined with `--join` from
    another path resolving to the same run (a symlink, as a second mount or prefix would), with its own
    environment and its own (fast: at tiny step times a slow link makes every answer late) link."""
    # 300k tokens: the run must outlast the joiner's start (a new process importing torch, ~5-10 s on a
    # loaded 2-core machine); at 100k site a finished first under load and site b merged nothing.
    cfg = tiny_config(
        "tworeg", "diloco.token_budget=300000", "diloco.learners=2", "sft=null", "train.checkpoint_every_s=5"
    )
    run = LocalRun(cfg, tmp_path / "a", extra_env={"DDILOCO_SITE": "a"}, metrics_base_port=-1)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "mount").symlink_to(tmp_path / "a", target_is_directory=True)
    join_url = f"file://{tmp_path}/b/mount/{cfg.run_id}"
    joined: dict = {}

    def join_when_prepared() -> None:
        store = open_store(join_url)
        deadline = time.monotonic() + 120
        while not store.exists(keys.global_key(0, 0)) and time.monotonic() < deadline:
            time.sleep(0.2)
        # Its own environment: only the run key (a Secret both clusters hold) is shared with site a.
        env = {**os.environ, "DDILOCO_SITE": "ignored-by-flag", "OMP_NUM_THREADS": "1",
               signing.ENV_VAR: run.extra_env[signing.ENV_VAR]}  # fmt: skip
        cmd = [sys.executable, "-m", "ddiloco.cli", "learner", "--join", join_url, "--site", "b",
               "--link-bandwidth", "1Gbit", "--link-latency", "1ms"]  # fmt: skip
        with open(tmp_path / "joined.log", "wb") as log:
            joined["rc"] = subprocess.run(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=300
            ).returncode

    joiner = threading.Thread(target=join_when_prepared, daemon=True)
    joiner.start()
    summary = run.run(timeout=300)
    joiner.join(timeout=120)
    log_text = (tmp_path / "joined.log").read_text()
    assert joined.get("rc") == 0, log_text[-3000:]
    assert summary.status == "done" and summary.ledger_balanced and not summary.rejected_updates
    assert summary.learners_by_site == {"a": [0, 1], "b": [2]}, summary.learners_by_site
    by_site = summary.tokens_merged_by_site
    assert by_site["a"] > 0 and by_site["b"] > 0, by_site
    assert sum(by_site.values()) == pytest.approx(summary.tokens_merged)
    report_md = open_store(run.url).get("report/summary.md").decode()
    assert "## Sites" in report_md and "| b | 2 |" in report_md
