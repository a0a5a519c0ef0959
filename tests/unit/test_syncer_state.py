"""The syncer's fp32 master across a restart (`ddiloco.syncer.state`, issue 16 item 4): with bf16 globals a
restarted syncer continues from the signed master it persisted, not from the rounded published values."""

import logging
import uuid

import pytest
import torch

from ddiloco import keys
from ddiloco.protocol import signing, wire
from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.wire import RunSigner
from ddiloco.run.fragments import Fragment
from ddiloco.run.globalmodel import Layout, publish_global
from ddiloco.run.root import RunRoot
from ddiloco.store.memory import MemoryStore
from ddiloco.syncer.fragment import GlobalFragment, MergeRule
from ddiloco.syncer.rounds import Answer, Round
from ddiloco.syncer.state import SyncerFiles

RUN = "r"
KEY = signing.for_run(b"master-key" * 4, RUN)
GAIN = "h.0.ln_1.weight"
LAYOUT = Layout(
    fragments=[Fragment(0, (GAIN,), 16)], shapes={GAIN: [16]}, embedding_names=frozenset(), model={}
)
RULE = MergeRule(
    method="rda",
    outer_lr=0.7,
    outer_momentum=0.9,
    token_weighting=True,
    robust_clip=None,
    embedding_names=frozenset(),
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def files(store: MemoryStore, dtype: str) -> SyncerFiles:
    return SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT, dtype)


def merged_run(dtype: str, rounds: int = 10) -> tuple[MemoryStore, GlobalFragment]:
    """A syncer that merged `rounds` rounds of four learners raising the gain by 3e-4, persisting each merge
    as the loop does, and crashed before writing its state (the restart adopts every version)."""
    store = MemoryStore(f"syncer-state-{uuid.uuid4().hex}")
    publish_global(store, RunSigner(RUN, KEY), 0, 0, {GAIN: torch.ones(16)}, dtype)
    f = files(store, dtype)
    frag = f.resume(RULE, 0.0).fragments[0]
    for r in range(rounds):
        got = frag.base(frag.version)  # what the learners received
        header = UpdateHeader(base_version=frag.version, c_tokens=640, c_steps=10, c_seconds=1.0)
        delta = {GAIN: (got[GAIN] + 3e-4) - got[GAIN]}
        answers = {f"{m}-0": Answer(f"{m}-0", header, delta) for m in range(4)}
        proposal = frag.propose(answers, RULE)
        f.publish(proposal, proposal.record(Round(r, 0, 0.0, 0.0), now=0.0, merged_at=0.0))
        frag.commit(proposal, published_at=0.0, clock=0.0)
    return store, frag


def test_a_restarted_syncer_continues_from_the_fp32_master_not_the_rounded_global():
    store, before = merged_run("bf16")
    after = files(store, "bf16").resume(RULE, 0.0).fragments[0]
    assert after.version == before.version == 10
    published = after.base(after.version)[GAIN]
    assert not torch.equal(before.theta[GAIN], published)  # the master is ahead of what was published
    assert torch.equal(after.theta[GAIN], before.theta[GAIN])  # bit for bit
    assert torch.equal(published, before.theta[GAIN].to(torch.bfloat16).float())
    assert torch.equal(after.outer.state_dict()[GAIN], before.outer.state_dict()[GAIN])


@pytest.mark.parametrize("damage", ["missing", "foreign_signature", "wrong_shape"])
def test_an_unusable_master_falls_back_to_the_published_values(damage, caplog):
    store, before = merged_run("bf16")
    key, meta = keys.master_key(0, 10), {"run_id": RUN, "kind": "master", "fragment_id": 0, "version": 10}
    if damage == "missing":
        store.delete(key)
    elif damage == "foreign_signature":
        store.put(key, wire.pack(before.theta, meta, key=signing.for_run(b"other" * 8, RUN)))
    else:
        store.put(key, wire.pack({GAIN: torch.zeros(4)}, meta, key=KEY))
    with caplog.at_level(logging.ERROR, logger="ddiloco.syncer.state"):
        after = files(store, "bf16").resume(RULE, 0.0).fragments[0]
    assert torch.equal(after.theta[GAIN], after.base(10)[GAIN])
    assert "fp32 master of fragment 0 v10 unusable" in caplog.text


def test_fp32_globals_write_no_master():
    store, before = merged_run("fp32", rounds=3)
    assert store.list("syncer/master/") == []
    after = files(store, "fp32").resume(RULE, 0.0).fragments[0]
    assert torch.equal(after.theta[GAIN], before.theta[GAIN])
