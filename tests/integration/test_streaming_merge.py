"""The syncer merges from running sums (issue 16 item 1): a round keeps no decoded answer, and the merge equals
the batch merge of the same answers read back from the store."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol.wire import PayloadError
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from ddiloco.syncer.rounds import Answer
from tests._harness import drive, tiny_config


@pytest.mark.parametrize(
    ("robust_clip", "threads", "codec"),
    [(None, None, "fp32"), (1.05, None, "int4"), (None, 2, "int4"), (1.05, 3, "int4")],
)
def test_rounds_hold_sums_not_answers_and_merge_like_the_batch_merge(robust_clip, threads, codec):
    """With robust_clip 1.05 most rounds of two or more answers clip one (the largest norm is above 1.05 ×
    the median), so the clipped answers' second read is exercised. With 3 threads the intake reads and
    checks answers ahead while the loop adds them (in listing order). int4 answers are added straight from
    their codes with the norms the learners claim: with 3 threads the readers measure them, with 2 the merge
    does (`MEASURE_IN_READERS_FROM`)."""
    store = open_store(f"memory://stream-{robust_clip}-{threads}")
    cfg = tiny_config(
        "stream", "diloco.learners=3", "diloco.quorum=2", "diloco.token_budget=8000", f"diloco.codec={codec}"
    )
    prepare(store, cfg)
    torch_threads = torch.get_num_threads()
    syncer = Syncer.open(store, poll_s=0, robust_clip=robust_clip, threads=threads)
    assert (syncer.intake.pool is not None) == (threads is not None)
    assert syncer.intake.measure == (threads == 3)
    learners = [Learner.open(store, i) for i in range(3)]
    for learner in learners:
        learner.start()
    merge, checked, clipped = syncer.rounds.merge, [], []

    def checked_merge(rnd, now):
        if rnd.round in syncer.rounds.unpublished or syncer.publisher.busy():  # proposes nothing on this call
            merge(rnd, now)
            return
        assert rnd.sums is not None and set(rnd.sums.answers) == set(rnd.answers)
        assert all(a.delta is None and a.encoded is None for a in rnd.answers.values()), (
            "a round keeps no answer"
        )
        # learners claim the norms the syncer measures: one pass per answer, no correction
        assert (rnd.sums.unclaimed, rnd.sums.corrections) == (0, 0)
        frag = syncer.fragments[rnd.fragment_id]
        batch_answers = {
            c: dataclasses.replace(a, delta=syncer.intake.reread(rnd, c)) for c, a in rnd.answers.items()
        }
        # no sums: the answers carry their deltas; the same merged progress (the momentum follows the decay)
        final = syncer.rounds.merges_to_the_mean()  # the run's last merges: the same rule as the syncer's
        batch = frag.propose(batch_answers, syncer.rule, tokens_merged=syncer.tokens_merged(), final=final)
        merge(rnd, now)
        # the proposal waits for the publisher, is being published, or was committed already
        held = syncer.publisher.flight.get(rnd.round)
        pending = syncer.rounds.unpublished.get(rnd.round) or (held.pending if held is not None else None)
        proposal = pending.proposal if pending is not None else None
        assert (proposal.version if proposal else frag.version) == batch.version
        for n, t in batch.theta.items():
            got = proposal.theta[n] if proposal else frag.theta[n]
            torch.testing.assert_close(got, t, rtol=1e-6, atol=1e-6)
        checked.append(len(rnd.answers))
        clipped.extend(batch.clipped)

    syncer.rounds.merge = checked_merge
    drive(syncer, learners)
    assert len(checked) >= 10 and max(checked) >= 2
    if robust_clip is not None:
        assert clipped, "no round clipped an answer: the reread path was not exercised"
    assert build_summary(store).ledger_balanced
    torch.set_num_threads(torch_threads)


def test_an_answer_changed_after_it_was_accepted_is_not_merged_from_other_bytes():
    """The sums hold what was accepted; a second read (clipping, single answers) must find the same bytes:
    the same header (`accepted_digest`), whose data checksum `wire.unpack` verifies again."""
    store = open_store("memory://stream-changed")
    prepare(store, tiny_config("changed", "diloco.learners=1", "diloco.token_budget=100000"))
    syncer = Syncer.open(store, poll_s=0)
    learner = Learner.open(store, 0)
    learner.start()
    for _ in range(2000):
        syncer.step()
        learner.poller.poll_once()
        learner.tick()
        filed = [(r, a) for r in syncer.rounds.open.values() for a in r.answers.values()]
        if filed:
            break
    rnd, ans = filed[0]
    assert isinstance(ans, Answer) and ans.delta is None
    blob = bytearray(store.get(ans.key))
    blob[-1] ^= 0xFF  # other data under the same header: the header no longer vouches for it
    store.put(ans.key, bytes(blob))
    with pytest.raises(PayloadError, match="checksum"):
        syncer.intake.reread(rnd, ans.contributor)
    version = syncer.fragments[rnd.fragment_id].version
    syncer.rounds.merge(rnd, syncer.clock())  # a merge that needs the second read abandons the round instead
    assert rnd.round not in syncer.rounds.open and syncer.fragments[rnd.fragment_id].version == version
    assert syncer.books.rounds_abandoned == 1
