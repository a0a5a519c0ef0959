"""A learner with two data-parallel ranks (gloo, real processes): lockstep, exact gradients, merges, resume.

Rank 0 is the ordinary `Learner` with a `ddp.Group`; rank 1 is a `ddp.Follower` that is never given the
store's address, so it cannot talk to the store. Each rank saves its final parameters and data cursor to a
scratch directory (written by this harness, not by the library) for the assertions.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ddiloco import keys
from ddiloco.learner import ddp
from ddiloco.learner.loop import Learner
from ddiloco.platform.ports import free_port
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import wire
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer, run_until_done
from tests._harness import tiny_config
from tests._ranks import one_process_reference, spawn_ranks

WORLD = 2
STEPS = 5


def _rank_main(rank: int, url: str | None, port: int, max_steps: int | None, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )  # fmt: skip
    torch.set_num_threads(1)
    group = ddp.from_env("cpu")
    assert group is not None and group.rank == rank
    try:
        if url is None:  # rank 0 ends before handing over the run (as when the run is already done)
            if rank > 0:
                follower = ddp.Follower(group)
                assert follower.stopped and follower.run() == 0
            Path(f"{out}/rank{rank}.json").write_text("{}")
            return
        if rank == 0:
            learner = Learner.open(open_store(url), 0, device="cpu", group=group)
            reason = learner.run(max_steps=max_steps, wait_timeout=60)
            model, loader = learner.model, learner.loader
            info = {"reason": reason, "steps": learner.inner_step, "tokens": learner.ledger.tokens_processed}
            info["anchors"] = [f.anchor for f in learner.ledger]
        else:
            follower = ddp.Follower(group)  # no store: everything comes from rank 0
            assert follower.run() == 0
            model, loader, info = follower.model, follower.loader, {"steps": follower.steps}
        save_file(
            {n: p.detach().contiguous() for n, p in model.named_parameters()}, f"{out}/rank{rank}.safetensors"
        )
        Path(f"{out}/rank{rank}.json").write_text(json.dumps({**info, "cursor": loader.state_dict()}))
    finally:
        group.close()


def _launch(url: str | None, out: Path, max_steps: int | None, timeout: float = 120) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_rank_main, (url, free_port(), max_steps, str(out)), WORLD, timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _params(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"rank{rank}.safetensors"))


def _checkpoint_meta(store) -> dict:
    pointer = store.get_json(keys.ckpt_latest_key(0))
    return wire.unpack(store.get(pointer["key"])).meta


def test_two_ranks_match_one_process_on_the_concatenated_batch_then_merge_and_resume(tmp_path):
    url = f"file://{tmp_path}/store/ddp"
    cfg = tiny_config(
        "ddp", "diloco.learners=1", "train.ranks=2", "train.checkpoint_every_s=0", "diloco.token_budget=6000"
    )
    store = open_store(url)
    prepare(store, cfg)
    B = cfg.train.batch_size

    # --- launch A: no syncer, so the ranks only take inner steps (and checkpoint every step) ---------------
    a = _launch(url, tmp_path / "a", STEPS)
    assert a[0]["reason"] == "max_steps" and a[0]["steps"] == a[1]["steps"] == STEPS
    assert a[0]["tokens"] == STEPS * WORLD * B * cfg.model.seq_len
    p0, p1 = _params(tmp_path / "a", 0), _params(tmp_path / "a", 1)
    assert all(torch.equal(p0[n], p1[n]) for n in p0)

    # Reference: one process, global version 0, each step on the ranks' batches concatenated.
    ref, opt, loaders, start = one_process_reference(store, cfg, WORLD, STEPS)
    b = ddp.slice_bounds(RunRoot(store, cfg.run_id).shard(0).numel(), WORLD)
    for n, v in ref.named_parameters():
        assert not torch.equal(v, start[n]), n  # the reference really trained every tensor
        torch.testing.assert_close(p0[n], v.detach(), rtol=1e-4, atol=1e-5, msg=n)
    for r in range(WORLD):
        assert a[r]["cursor"]["index"] == loaders[r].index == STEPS * B

    meta = _checkpoint_meta(store)
    cursors = meta["cursors"]
    assert len(cursors) == WORLD and all(c["index"] > 0 for c in cursors)
    assert [c["num_tokens"] for c in cursors] == [b[1] - b[0], b[2] - b[1]]

    # --- launch B: a syncer merges until the budget; rank 0 resumes from its checkpoint ---------------------
    syncer = Syncer.open(open_store(url), poll_s=0.01)
    thread = threading.Thread(target=run_until_done, args=(syncer, 100), daemon=True)
    thread.start()
    bres = _launch(url, tmp_path / "b", None)
    thread.join(timeout=60)
    assert bres[0]["reason"] == "done"
    steps_b = bres[1]["steps"]
    assert steps_b == bres[0]["steps"] - meta["inner_step"] > 0  # inner steps resume from the checkpoint
    assert max(bres[0]["anchors"]) >= 1  # rank 0 took new global versions...
    q0, q1 = _params(tmp_path / "b", 0), _params(tmp_path / "b", 1)
    assert all(torch.equal(q0[n], q1[n]) for n in q0)  # ...and rank 1 received them (and the AdamW state)
    for r, loader in enumerate(loaders):  # every rank's data cursor resumed where the checkpoint left it
        loader.load_state_dict({**cursors[r], "seed": loader.seed})
        for _ in range(steps_b):
            loader.next_batch()
        assert bres[r]["cursor"] == loader.state_dict()
    s = build_summary(store)
    assert s.status == "done" and s.ledger_balanced and s.tokens_outstanding == 0
    assert s.tokens_processed == (STEPS + steps_b) * WORLD * B * cfg.model.seq_len


def test_single_process_learner_has_no_group_and_early_exit_releases_followers(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ddp.from_env("cpu") is None
    assert _launch(None, tmp_path, None, timeout=60) == [{}, {}]


def test_two_ranks_share_a_streamed_corpus_slot_and_resume_their_own_cursors(tmp_path):
    """A pre-tokenized corpus read in place (`ddiloco.data.streamed`): rank r reads every second chunk of the
    learner's slot from the r-th, the ranks stay identical, and a second launch resumes each rank's stream
    cursor from the checkpoint (cursors travel as JSON, not as ShardLoader rows)."""
    import numpy as np

    from ddiloco.data.loader import tokenize_corpus
    from ddiloco.data.streamed import open_loader, read_corpus_doc
    from ddiloco.data.synthetic import make_world, synthetic_documents
    from ddiloco.data.tokenizer import ByteTokenizer

    ids = tokenize_corpus(synthetic_documents(make_world(0, 8), 0, 1200), ByteTokenizer()).numpy()
    (tmp_path / "corpus").mkdir()
    for i, part in enumerate(np.array_split(ids, 3)):
        np.save(tmp_path / "corpus" / f"part-{i}.npy", part.astype(np.uint16))
    url = f"file://{tmp_path}/store/ddp-stream"
    cfg = tiny_config(
        "ddp-stream", "diloco.learners=1", "train.ranks=2", "train.checkpoint_every_s=0",
        f"data.source={tmp_path / 'corpus'}", "data.tokenizer=byte", "data.chunk_tokens=2048",
    )  # fmt: skip
    store = open_store(url)
    prepare(store, cfg)
    a = _launch(url, tmp_path / "a", STEPS)
    assert a[0]["steps"] == a[1]["steps"] == STEPS
    p0, p1 = _params(tmp_path / "a", 0), _params(tmp_path / "a", 1)
    assert all(torch.equal(p0[n], p1[n]) for n in p0)
    cursors = _checkpoint_meta(store)["cursors"]
    assert [c["format"] for c in cursors] == ["ddiloco.data.tokens.cursor/1"] * WORLD
    assert cursors[0]["assignment"] != cursors[1]["assignment"], "the ranks read different chunks"

    b = _launch(url, tmp_path / "b", 3)
    doc, B = read_corpus_doc(store), cfg.train.batch_size
    seed = ddp.rank_seed(cfg.seed * 1000, 1)
    follower = open_loader(doc, 0, batch_size=B, seq_len=cfg.model.seq_len, seed=seed, part=(1, WORLD))
    follower.load_state_dict(cursors[1])
    for _ in range(3):
        follower.next_batch()
    assert b[1]["cursor"] == follower.state_dict()  # rank 1 resumed from its checkpointed cursor
    follower.close()
