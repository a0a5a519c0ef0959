"""A learner pod holds only a learner's share of the key (issue 49): what it forges is refused, and the run
finishes. Driven with the deterministic in-process runs of `test_bad_inputs` (one thread, a syncer clock of
one "second" per pass), so a forgery that changed nothing leaves the final model bitwise equal to the clean
run's. At 6e3bd56 every pod held the one run key: a global version, a status or a done marker signed with it
(or, for the status and done marker, not signed at all) was believed."""

from __future__ import annotations

import pytest
import torch

from ddiloco import keys
from ddiloco.cli.roles import _signed_done
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import signing
from ddiloco.protocol.wire import RunSigner
from ddiloco.run.globalmodel import pack_global
from ddiloco.run.root import RunRoot
from ddiloco.syncer.loop import Syncer
from tests.integration.test_bad_inputs import SECRET, Run, assert_bitwise_equal, rel_distance, run

pytestmark = pytest.mark.slow


def share(r: Run) -> signing.RunKeys:
    """The keys a learner pod of run `r` holds: its share, derived like a pod's environment gives it."""
    keys_ = signing.for_run(signing.key_from_env(signing.learner_env(SECRET)), r.name)
    assert keys_ is not None and keys_.seed is None
    return keys_


def learner_signed_global(r: Run, p: int, version: int, epoch: int) -> bytes:
    """A global version with the right shapes and a high epoch, signed the only way a learner can: its HMAC
    key over a header relabelled as the syncer's kind."""
    layout = r.syncer.layout
    tensors = {n: torch.zeros(layout.shapes[n]) for n in layout.fragments[p].names}
    blob = pack_global(RunSigner(r.name, None), p, version, tensors, "fp32", {"round": 0, "epoch": epoch})
    from tests.unit.test_signing import _rewrite_header

    mine = share(r)
    return _rewrite_header(
        blob,
        lambda h, m: m.update(
            key_id=signing.key_id(mine.learner),
            mac=signing._mac(mine.learner, b"ddiloco-payload\0" + signing.canonical(m)),
        ),
    )


def initial(r: Run) -> dict[str, torch.Tensor]:
    """The run's version-0 model."""
    model = RunRoot(r.store, r.name, signing.for_run(SECRET, r.name)).model_at_versions(
        r.syncer.layout, [0] * r.syncer.P
    )
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def clean() -> Run:
    return run("keys-ref")


def test_a_forged_global_version_with_a_high_epoch_and_a_forged_done_marker_change_nothing(clean):
    forged: list[str] = []

    def before(r: Run, s: int) -> None:
        if s == 3:  # the next version of fragment 1, with an epoch far above the syncer's
            p = s % r.syncer.P
            key = keys.global_key(p, r.syncer.versions[p] + 1)
            r.store.put(key, learner_signed_global(r, p, r.syncer.versions[p] + 1, epoch=99))
            forged.append(key)
        if s == 4:  # "the run is done": unsigned, then signed with a learner's key
            r.store.put_json(keys.DONE, {"time": 0.0, "tokens_merged": 1e12, "reason": "budget"})
            assert not _signed_done(r.store, signing.key_from_env(signing.learner_env(SECRET)))
            doc = signing.sign_doc(r.store.get_json(keys.DONE), share(r), signing.LEARNER)
            r.store.put_json(keys.DONE, doc)
            assert not RunRoot(r.store, r.name, share(r)).is_done()
            assert not RunRoot(r.store, r.name, signing.for_run(SECRET, r.name)).is_done()

    live = run("keys-forged", before=before)
    assert forged and sum(live.syncer.files.slots.quarantined.values()) == 1, "the forgery was set aside"
    assert_bitwise_equal(live.final, clean.final)
    assert build_summary(live.store).ledger_balanced
    assert RunRoot(live.store, live.name, share(live)).is_done()  # the syncer's own marker replaced it
    # a restarted syncer (the high epoch fenced it: exit 3 on every restart) resumes where it was
    p = 1
    live.store.put(
        keys.global_key(p, live.syncer.versions[p] + 1), learner_signed_global(live, p, 99, epoch=99)
    )
    assert Syncer.open(live.store, secret=SECRET).versions == live.syncer.versions


def test_a_forged_done_status_stops_no_learner(clean):
    """A status saying "done" (signed with a learner's key, or not at all) is ignored by every learner: the
    run finishes and the ledger balances (not bitwise equal to the clean run: a learner that ignored a
    status acts on the syncer's next one, up to a heartbeat later, and the rounds' timing moves; the model
    stays within half of training's displacement of the clean one, measured 0.21)."""

    def before(r: Run, s: int) -> None:
        if s in (4, 6):
            status = {**r.store.get_json(keys.STATUS), "done": True, "closing": True}
            r.store.put_json(keys.STATUS, signing.sign_doc(status, share(r), signing.LEARNER))
        if s == 5:
            status = r.store.get_json(keys.STATUS)
            r.store.put_json(
                keys.STATUS, {k: v for k, v in status.items() if k != "signature"} | {"done": True}
            )

    live = run("keys-status", before=before)
    assert build_summary(live.store).ledger_balanced
    assert all(learner.poller.refused >= 1 for learner in live.learners)
    assert rel_distance(live.final, clean.final, initial(live)) < 0.5


def test_a_learner_share_cannot_run_a_role_that_signs_as_the_syncer(tmp_path):
    from ddiloco.errors import ConfigError

    r_share = signing.key_from_env(signing.learner_env(SECRET))
    with pytest.raises(ConfigError, match="needs DDILOCO_RUN_KEY"):
        RunRoot.keyed(None, "x", r_share, role="syncer")  # type: ignore[arg-type]


def test_a_current_global_version_that_no_longer_verifies_is_republished_and_the_run_finishes(clean):
    """The newest version of a fragment, overwritten or corrupted in transit (big S3 bodies go up with an
    unsigned payload), used to make the syncer crash-loop: its read-back error escaped the retry loop."""
    hit: list[int] = []

    def before(r: Run, s: int) -> None:
        if s in (5, 9):
            p = s % r.syncer.P
            key = keys.global_key(p, r.syncer.versions[p])
            blob = bytearray(r.store.get(key))
            blob[-3] ^= 0xFF  # one flipped byte of the data region: `checksum`
            r.store.put(key, bytes(blob))
            hit.append(p)

    live = run("keys-corrupt", before=before)
    assert len(hit) == 2
    assert build_summary(live.store).ledger_balanced
    assert rel_distance(live.final, clean.final, initial(live)) < 0.5
