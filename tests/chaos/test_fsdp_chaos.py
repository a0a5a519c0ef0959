"""`ddiloco run` with FSDP2 learners (two sharded ranks each, `--local-ranks`), one of them SIGKILLed mid-run:
its ranks die with it, it comes back as a new incarnation whose ranks rejoin from its checkpoint, and the
books balance."""

import os
import re

import pytest

from ddiloco.launch import LocalRun
from ddiloco.store.url import open_store
from tests._harness import tiny_config
from tests.chaos.test_local_chaos import assert_no_lost_or_double_merges

pytestmark = pytest.mark.slow

# Checkpoints every 0.25 s: on a quiet machine 30 steps take under a second, and the kill must come after the
# learner's first checkpoint (with 1 s it came before it, and nothing was restored).
FSDP = ("diloco.learners=2", "diloco.fragments=2", "train.ranks=2", "train.parallel=fsdp", "sft=null",
        "diloco.sync_every=8", "train.checkpoint_every_s=0.25", "diloco.token_budget=80000",
        "eval.curve_points=2", "chaos.events=[{kind: kill_learner, learner: 1, at_step: 30}]")  # fmt: skip


def test_fsdp_learners_survive_a_kill_with_the_ledger_balanced(tmp_path):
    run = LocalRun(tiny_config("fsdp-kill", *FSDP), tmp_path)
    s = run.run(timeout=600)
    assert s.status == "done"
    fired = [e for e in s.chaos_events if e.get("action") == "SIGKILL (self)"]
    assert [e["learner"] for e in fired] == [1], s.chaos_events
    assert s.incarnations["1"] == 2 and s.incarnations["0"] == 1
    assert s.tokens_outstanding == 0
    assert s.tokens_processed == s.tokens_merged + s.tokens_discarded
    assert_no_lost_or_double_merges(open_store(run.url), s)
    assert all(k["rejoin_seconds"] is not None for k in s.kill_recovery), s.kill_recovery
    # Both incarnations ran two ranks: a step covers two batches.
    assert s.final_val_loss < s.initial_val_loss
    log = (run.logdir / "learner-1.log").read_text()
    assert log.count("learner ranks 1..1 started") == 2, "each incarnation started its own follower"
    assert "learner 1: restored checkpoint at inner step" in log  # the AdamW state went back into the shards
    for pid in re.findall(r"learner ranks 1\.\.1 started \(pids \[(\d+)\]\)", log):
        with pytest.raises(ProcessLookupError):  # the killed incarnation's follower died with it
            os.kill(int(pid), 0)
