"""Compressed downloads in an in-process run (issue 16 item 5): learners download less, and hold exactly the
published values."""

import torch

from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.globalmodel import latest_version, read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import drive, tiny_config


def _run(name: str, codec: str):
    store = open_store(f"memory://{name}")
    cfg = tiny_config(name, f"diloco.download_codec={codec}", "diloco.codec=int4")
    prepare(store, cfg)
    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    return store, cfg, learners, build_summary(store)


def downloads(learners, layout) -> int:
    return sum(sum(lr.feed.fetched.values()) + layout.num_fragments for lr in learners)


def test_learners_download_deltas_and_hold_the_published_values():
    _, _, full_learners, full = _run("down-none", "none")
    store, cfg, learners, s = _run("down-int8", "int8")
    assert s.status == "done" and s.rejected_updates == {}
    assert full.bytes_downloaded > 0
    layout = read_layout(store)
    # Per download (start-up ones included: every learner fetches every fragment in full once), as the two
    # runs need not publish the same number of versions.
    per_download = s.bytes_downloaded / downloads(learners, layout)
    per_download_full = full.bytes_downloaded / downloads(full_learners, layout)
    assert per_download < 0.5 * per_download_full, (per_download, per_download_full)
    assert all(set(lr.feed.fetched) == {"full"} for lr in full_learners)
    for learner in learners:
        assert learner.feed.fetched["delta"] > 0 and not learner.feed.rejected_globals
        for p, (version, _) in learner.feed.held.items():
            held = RunRoot(store, cfg.run_id).read_global(layout, p, version)
            for n, t in held.items():  # bit for bit what the full version holds
                assert torch.equal(learner.feed.anchors[n].view(torch.int32), t.view(torch.int32))
    assert all(latest_version(store, p) >= 1 for p in range(layout.num_fragments))
