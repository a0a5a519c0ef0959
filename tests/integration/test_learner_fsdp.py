"""A learner whose two ranks shard the model (FSDP2, `train.parallel=fsdp`; gloo, real processes): exact
training against one process, the AdamW state through a checkpoint and back into the shards, merges.

Rank 0 is the ordinary `Learner` with a `ddp.Group`; rank 1 is a `ddp.Follower` that never gets the store's
address. After the learner ends, both ranks gather the parameters and the AdamW state to rank 0 (a
collective of this harness, through the library's `full_tensors`) and rank 0 saves them to a scratch
directory for the assertions.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ddiloco import keys
from ddiloco.learner import ddp, sharded
from ddiloco.learner.fsdp import full_tensors
from ddiloco.learner.loop import Learner
from ddiloco.platform.ports import free_port
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import wire
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer, run_until_done
from tests._harness import tiny_config
from tests._ranks import one_process_reference, spawn_ranks

WORLD = 2
STEPS = 4


def _rank_main(rank: int, url: str, port: int, max_steps: int | None, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )  # fmt: skip
    torch.set_num_threads(1)
    group = ddp.from_env("cpu")
    assert group is not None
    try:
        if rank == 0:
            learner = Learner.open(open_store(url), 0, device="cpu", group=group)
            reason = learner.run(max_steps=max_steps, wait_timeout=60)
            model, opt, loader = learner.model, learner.opt, learner.loader
            info = {"reason": reason, "steps": learner.inner_step, "tokens": learner.ledger.tokens_processed}
            info["anchors"] = [f.anchor for f in learner.ledger]
        else:
            follower = ddp.Follower(group)
            assert follower.run() == 0
            model, opt, loader, info = (
                follower.model,
                follower.opt,
                follower.loader,
                {"steps": follower.steps},
            )
        assert group.sharded
        names = [n for n, _ in model.named_parameters()]
        params = full_tensors(model, names, out_device="cpu")  # both ranks: a collective
        moments = sharded._gather_optimizer(model, opt)
        if rank == 0:
            assert params is not None
            save_file({n: t.contiguous() for n, t in params.items()}, f"{out}/params.safetensors")
            save_file(
                {n: t.contiguous().reshape(t.shape) for n, t in moments.items()}, f"{out}/opt.safetensors"
            )
        Path(f"{out}/rank{rank}.json").write_text(json.dumps({**info, "cursor": loader.state_dict()}))
    finally:
        group.close()


def _launch(url: str, out: Path, max_steps: int | None, timeout: float = 180) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    spawn_ranks(_rank_main, (url, free_port(), max_steps, str(out)), WORLD, timeout)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _checkpoint(store) -> wire.Payload:
    pointer = store.get_json(keys.ckpt_latest_key(0))
    return wire.unpack(store.get(pointer["key"]))


def test_sharded_ranks_train_like_one_process_checkpoint_whole_state_and_resume_into_shards(tmp_path):
    url = f"file://{tmp_path}/store/fsdp"
    cfg = tiny_config(
        "fsdp", "diloco.learners=1", "train.ranks=2", "train.parallel=fsdp", "train.checkpoint_every_s=0",
        "diloco.token_budget=6000",
    )  # fmt: skip
    store = open_store(url)
    prepare(store, cfg)
    B = cfg.train.batch_size

    # --- launch A: no syncer, so the ranks only take inner steps (and checkpoint every step) ---------------
    a = _launch(url, tmp_path / "a", STEPS)
    assert a[0]["reason"] == "max_steps" and a[0]["steps"] == a[1]["steps"] == STEPS
    assert a[0]["tokens"] == STEPS * WORLD * B * cfg.model.seq_len
    got = load_file(str(tmp_path / "a" / "params.safetensors"))

    # Reference: one process, global version 0, each step on the ranks' batches concatenated.
    ref, opt, loaders, start = one_process_reference(store, cfg, WORLD, STEPS)
    for n, v in ref.named_parameters():
        assert not torch.equal(v, start[n]), n  # the reference really trained every tensor
        torch.testing.assert_close(got[n], v.detach(), rtol=1e-4, atol=1e-5, msg=n)

    # The checkpoint holds the whole AdamW state (single-process format), equal to the reference's.
    ckpt = _checkpoint(store)
    assert ckpt.meta["inner_step"] == STEPS and len(ckpt.meta["cursors"]) == WORLD
    for n, p in ref.named_parameters():
        assert float(ckpt.tensors[f"opt/{n}/step"]) == STEPS
        for field in sharded.MOMENTS:
            ours = ckpt.tensors[f"opt/{n}/{field}"]
            assert ours.shape == p.shape, n
            torch.testing.assert_close(ours, opt.state[p][field], rtol=1e-3, atol=1e-7, msg=f"{n} {field}")

    # --- launch B: start only; the checkpoint's state is scattered back into the shards ----------------------
    _launch(url, tmp_path / "b", 0)
    back = load_file(str(tmp_path / "b" / "opt.safetensors"))
    for name, value in ckpt.tensors.items():
        assert torch.equal(back[name].reshape(value.shape), value.to(back[name].dtype)), name

    # --- launch C: a syncer merges until the budget ----------------------------------------------------------
    syncer = Syncer.open(open_store(url), poll_s=0.01)
    thread = threading.Thread(target=run_until_done, args=(syncer, 100), daemon=True)
    thread.start()
    c = _launch(url, tmp_path / "c", None)
    thread.join(timeout=60)
    assert c[0]["reason"] == "done" and c[1]["steps"] == c[0]["steps"] - STEPS > 0
    assert max(c[0]["anchors"]) >= 1  # rank 0 took new global versions into the shards
    final = load_file(str(tmp_path / "c" / "params.safetensors"))
    assert any(not torch.equal(final[n], got[n]) for n in got)
    s = build_summary(store)
    assert s.status == "done" and s.ledger_balanced and s.tokens_outstanding == 0
