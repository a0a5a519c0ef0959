"""A syncer that dies between any two writes of a publish, or finds an unverifiable object at a version key
(`ddiloco.syncer.state`, `ddiloco.syncer.adopt`): the next syncer adopts or supersedes what it left, fences
only a newer writer, and quarantines what does not verify. Crashes are failpoints (`ddiloco.platform.failpoints`)."""

import uuid

import pytest
import torch

from ddiloco import keys
from ddiloco.platform import failpoints
from ddiloco.protocol import signing, wire
from ddiloco.protocol.messages import Ledger, RoundRecord, SyncerState
from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.wire import RunSigner
from ddiloco.run.globalmodel import latest_version, pack_global, publish_global
from ddiloco.run.root import RunRoot
from ddiloco.store.memory import MemoryStore
from ddiloco.syncer.fragment import GlobalFragment
from ddiloco.syncer.lease import Fenced
from ddiloco.syncer.rounds import Answer, Round
from ddiloco.syncer.state import SyncerFiles, credit
from tests.unit.test_syncer_state import GAIN, LAYOUT, RULE  # one fragment holding one 16-value tensor

RUN = "r"
KEY = signing.for_run(b"crash-key" * 4, RUN)
SIGNER = RunSigner(RUN, KEY)
CONFIGS = {  # (global dtype, download codec) -> the writes of one publish, in order
    ("fp32", "none"): ("after_momentum", "after_record", "after_global", "after_pointer"),
    ("bf16", "none"): ("after_momentum", "after_master", "after_record", "after_global", "after_pointer"),
    ("fp32", "int8"): (
        "after_momentum",
        "after_master",
        "after_record",
        "after_delta",
        "after_global",
        "after_pointer",
    ),
}
CASES = [(dtype, codec, step) for (dtype, codec), steps in CONFIGS.items() for step in steps]


@pytest.fixture(autouse=True)
def _clean():
    torch.set_num_threads(1)
    yield
    failpoints.disarm()


def new_run(dtype: str) -> MemoryStore:
    store = MemoryStore(f"publish-crash-{uuid.uuid4().hex}")
    publish_global(store, SIGNER, 0, 0, {GAIN: torch.ones(16)}, dtype)
    return store


def merge(files: SyncerFiles, frag: GlobalFragment, round_: int, epoch: int) -> RoundRecord:
    """One round of four learners merged and published as the loop does (commit and credit after)."""
    got = frag.base(frag.version)
    tokens = 640 + round_  # every round credits a different amount: a double or missing credit shows
    header = UpdateHeader(base_version=frag.version, c_tokens=tokens, c_steps=10, c_seconds=1.0)
    answers = {f"{m}-0": Answer(f"{m}-0", header, {GAIN: torch.full_like(got[GAIN], 3e-4)}) for m in range(4)}
    proposal = frag.propose(answers, RULE)
    record = proposal.record(Round(round_, 0, 0.0, 0.0), now=0.0, merged_at=0.0)
    record.epoch = epoch
    files.publish(proposal, record)
    frag.commit(proposal, published_at=0.0, clock=0.0)
    credit(frag.ledger, record)
    return record


def save(files: SyncerFiles, frag: GlobalFragment, next_round: int, epoch: int) -> None:
    files.save_state(
        SyncerState(
            run_id=RUN,
            incarnation=0,
            versions=[frag.version],
            ledger=[frag.ledger],
            rejected={},
            clipped={},
            next_round=next_round,
            rounds_merged=frag.version,
            rounds_abandoned=0,
            merged_recent=[],
            xi_quorum=0.0,
            xi_sync=0.0,
            started_wall=0.0,
            open_rounds=[],
            bytes_published=0,
            late_answers=0,
            learner_events=[],
            epoch=epoch,
        )
    )


def assert_one_merge_per_version(store: MemoryStore, ledger: Ledger) -> None:
    """Versions 1..latest exist, each with exactly one round record, the one its header names, and the
    ledger holds exactly those records' tokens."""
    latest = latest_version(store, 0)
    records = [store.get_json(k) for k in store.list(keys.ROUNDS)]
    assert sorted(r["version"] for r in records) == list(range(1, latest + 1))
    for r in records:
        header = wire.unpack(store.get(keys.global_key(0, r["version"])), key=KEY).meta
        assert header["round"] == r["round"]
    tokens = sum(c["c_tokens"] for r in records for c in r["contributors"].values())
    assert (ledger.merged_tokens, ledger.merged_answers) == (tokens, 4 * latest)


@pytest.mark.parametrize(("dtype", "codec", "step"), CASES)
def test_a_successor_adopts_or_supersedes_a_publish_cut_after_any_write(dtype, codec, step):
    store = new_run(dtype)
    first = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT, dtype, codec)
    frag = first.resume(RULE, 0.0).fragments[0]
    for r in range(2):
        merge(first, frag, r, epoch=1)
    save(first, frag, next_round=2, epoch=1)
    failpoints.arm("publish", step, "raise")
    with pytest.raises(failpoints.FailpointCrash):
        merge(first, frag, 2, epoch=1)  # dies here: nothing after this write happens
    failpoints.disarm()

    second = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT, dtype, codec)
    resumed = second.resume(RULE, 0.0)
    after = resumed.fragments[0]
    published = step in ("after_global", "after_pointer")  # the global version is the commit point
    assert after.version == (3 if published else 2)
    assert latest_version(store, 0) == after.version, "the pointer names what was adopted"
    assert resumed.books.next_round == (3 if published else 2)
    for r in range(resumed.books.next_round, resumed.books.next_round + 2):
        merge(second, after, r, epoch=2)  # no Fenced: the leftovers are adopted or overwritten
    assert after.version == latest_version(store, 0) == (5 if published else 4)
    assert_one_merge_per_version(store, after.ledger)
    assert store.list("syncer/quarantine/") == [], "a dead publish's leftovers verify: nothing is moved aside"


def test_a_version_found_by_its_own_or_a_newer_epoch_is_fenced_at_resume():
    store = new_run("fp32")
    first = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT)
    frag = first.resume(RULE, 0.0).fragments[0]
    merge(first, frag, 0, epoch=3)
    store.put_json(keys.global_latest_key(0), {"version": 0})  # as if the pointer had not been written
    for epoch in (2, 3):
        with pytest.raises(Fenced, match="written by epoch 3"):
            SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT).resume(RULE, 0.0, epoch)
    assert SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT).resume(RULE, 0.0, 4).fragments[0].version == 1


def planted(kind: str) -> bytes:
    """What someone who can write the run prefix might put at global v1 of fragment 0."""
    good = {GAIN: torch.ones(16)}
    if kind == "garbage":
        return b"not a payload"
    if kind == "foreign_run":
        return pack_global(RunSigner("other-run", KEY), 0, 1, good, "fp32", {"round": 0, "epoch": 0})
    if kind == "wrong_key":
        other = signing.for_run(b"k" * 32, RUN)
        return pack_global(RunSigner(RUN, other), 0, 1, good, "fp32", {"round": 0, "epoch": 0})
    if kind == "wrong_fragment":
        return pack_global(SIGNER, 1, 1, good, "fp32", {"round": 0, "epoch": 0})
    return pack_global(SIGNER, 0, 1, {GAIN: torch.full((16,), float("nan"))}, "fp32", {"round": 0})


KINDS = ["garbage", "foreign_run", "wrong_key", "wrong_fragment", "non_finite"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("when", ["before_resume", "while_running"])
def test_an_unverifiable_object_at_the_next_version_key_is_quarantined_and_the_run_goes_on(kind, when):
    store = new_run("fp32")
    blob = planted(kind)
    if when == "before_resume":
        store.put(keys.global_key(0, 1), blob)
    files = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT)
    frag = files.resume(RULE, 0.0).fragments[0]
    assert frag.version == 0
    if when == "while_running":
        store.put(keys.global_key(0, 1), blob)
    merge(files, frag, 0, epoch=1)
    merge(files, frag, 1, epoch=1)
    assert frag.version == latest_version(store, 0) == 2
    assert_one_merge_per_version(store, frag.ledger)
    assert sum(files.slots.quarantined.values()) == 1
    (aside,) = store.list(keys.QUARANTINE)
    assert aside.startswith(keys.quarantine_key(keys.global_key(0, 1), "e")) and store.get(aside) == blob
    save(files, frag, 2, epoch=1)
    state = store.get_json(keys.SYNCER_STATE)
    doc = state | {"quarantined": dict(files.slots.quarantined)}
    store.put_json(keys.SYNCER_STATE, signing.sign_doc(doc, KEY, signing.SYNCER))
    state = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT)
    state.resume(RULE, 0.0, 2)
    assert sum(state.slots.quarantined.values()) == 1, "the count survives a restart"


def test_a_version_an_older_epoch_publishes_meanwhile_is_superseded_not_overwritten():
    """The old holder's publish lands after the successor resumed: the successor neither overwrites it nor
    exits for good; it is told `Superseded` (the loop adopts the version: `ddiloco.syncer.loop`)."""
    from ddiloco.syncer.adopt import Superseded

    store = new_run("fp32")
    old = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT)
    new = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT)
    old_frag = old.resume(RULE, 0.0, 1).fragments[0]
    new_frag = new.resume(RULE, 0.0, 2).fragments[0]
    merge(old, old_frag, 0, epoch=1)
    blob = store.get(keys.global_key(0, 1))
    with pytest.raises(Superseded):
        merge(new, new_frag, 5, epoch=2)
    assert store.get(keys.global_key(0, 1)) == blob
    version, adopted = new.slots.adopt_after(0, 0, 2)
    assert version == 1 and [r.round for r in adopted] == [0]


def test_the_quarantine_count_is_exported_as_a_metric():
    from prometheus_client import CollectorRegistry

    from ddiloco.tracking.metrics import SyncerMetrics

    reg = CollectorRegistry()
    state = {"tokens_merged": 1, "tokens_discarded": 0, "token_budget": 2, "live_learners": 1}
    state |= {"goodput": 0.5, "merged_token_share": 0.9, "versions": [0], "quarantined": {"bad_signature": 2}}
    SyncerMetrics(reg, lambda: state)
    name = "ddiloco_syncer_quarantined_objects_total"
    assert reg.get_sample_value(name, {"reason": "bad_signature"}) == 2
