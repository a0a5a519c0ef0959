"""A run whose layout splits tensors into row pieces: learners and the syncer agree, and the final model is
the published globals put back together."""

import torch

from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import drive, tiny_config


def test_run_with_row_pieces_finishes_and_reassembles() -> None:
    store = open_store("memory://split-layout")
    # P = 4 on the test model: its token embedding and LM head are each larger than total / P
    # Full-fragment downloads: the final model (the syncer's master) then equals the latest published
    # versions exactly; with download deltas they are what learners hold, within a quantisation step.
    cfg = tiny_config(
        "split-layout", "diloco.fragments=4", "diloco.token_budget=6000", "diloco.download_codec=none"
    )
    prepare(store, cfg)
    root = RunRoot.open(store, None, role="test")
    layout = root.layout()
    assert {pc.tensor for pc in layout.pieces.values()} == {"transformer.wte.weight", "lm_head.weight"}
    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    s = build_summary(store)
    assert s.status == "done" and s.rejected_updates == {}
    assert s.ledger_balanced and min(s.global_versions) >= 1
    final = dict(root.final_model(layout).named_parameters())
    latest = dict(root.model_at_versions(layout, root.latest_versions(layout)).named_parameters())
    assert set(final) == set(latest)
    assert all(torch.equal(final[n], latest[n]) for n in final)
    v0 = dict(root.model_at_versions(layout, [0] * layout.num_fragments).named_parameters())
    assert not torch.equal(final["transformer.wte.weight"], v0["transformer.wte.weight"])
