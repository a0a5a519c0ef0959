"""A learner holding the run key cannot claim more than the run's config and the syncer's clocks allow
(`ddiloco.protocol.claims`), and no number in an unsigned report steers pacing (`ddiloco.protocol.reports`).

Driven through the real syncer: its intake reads real signed updates from the store, its roster real
report documents; the syncer's clocks are the test's."""

import functools
import logging
import math
import zlib

import pytest
import torch

from ddiloco import keys
from ddiloco.protocol import reports, signing, wire
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import tiny_config

SECRET = bytes.fromhex("3c" * 32)
TPS = 4 * 32  # tiny_config: train.batch_size × model.seq_len
STEP_S = 0.05  # the honest learners' wall seconds per step


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def report(lid: int, seq: int, t: float, *, wall_ema=STEP_S, **extra) -> dict:
    return {
        "learner_id": lid, "incarnation": 0, "seq": seq, "time": t, "started_at": 0.0, "joined_at": 0.0,
        "step_time_ema": 0.01, "step_wall_ema": wall_ema, "productive_seconds": 0.0, "tokens_processed": 0,
        "loss_ema": 2.0, "fragments": {}, "final": False, **extra,
    }  # fmt: skip


def put_report(store, syncer: Syncer, key: str, doc: dict) -> None:
    """A learner report signed with the learner key (the syncer ignores any other)."""
    store.put_json(key, signing.sign_doc(doc, signing.for_run(SECRET, syncer.run_id), signing.LEARNER))


@functools.cache
def prepared(overrides: tuple[str, ...]) -> dict[str, bytes]:
    """The objects of a prepared signed run, prepared once per config (copied into each test's store)."""
    store = open_store(f"memory://claims-prepared-{zlib.crc32(repr(overrides).encode())}")
    extra = ("diloco.learners=3", "diloco.grace=null", "diloco.round_timeout_s=1e9")
    prepare(store, tiny_config("claims", *extra, *overrides), secret=SECRET)
    return {k: store.get(k) for k in store.list("")}


def start(name: str, *overrides: str, cadences=(STEP_S, STEP_S, STEP_S)):
    """A prepared signed run, its syncer (clocks: the test's; the wall starts 100 s after the run was
    prepared) and live learners 0.. reporting `cadences`."""
    store = open_store(f"memory://{name}")
    for k, blob in prepared(overrides).items():
        store.put(k, blob)
    mono, wall = Clock(50.0), Clock(store.get_json(keys.DATA_META)["prepared_at"] + 100.0)
    syncer = Syncer.open(store, clock=mono, wall=wall, secret=SECRET, poll_s=0)
    syncer.test_cadences = list(cadences)  # what `advance` keeps reporting
    for lid, c in enumerate(cadences):
        put_report(store, syncer, keys.report_key(lid, 0), report(lid, 1, wall(), wall_ema=c))
    syncer.step()  # reads the reports, opens round 0 (fragment 0)
    assert list(syncer.rounds.open) == [0]
    return store, syncer, mono, wall


def update(syncer: Syncer, round_: int, lid: int, *, steps: int, seconds: float, **header) -> bytes:
    """A well-formed update signed with the run key (what any learner pod can make)."""
    layout, p = syncer.layout, round_ % syncer.P
    gen = torch.Generator().manual_seed(lid)
    tensors = {
        f"{n}/data": 1e-3 * torch.randn(math.prod(layout.shapes[n]), generator=gen)
        for n in layout.fragments[p].names
    }
    meta = {
        "run_id": syncer.run_id, "kind": "update", "learner_id": lid, "incarnation": 0, "fragment_id": p,
        "round": round_, "base_version": syncer.versions[p], "c_steps": steps, "c_tokens": steps * TPS,
        "c_seconds": seconds, "inner_step": steps, "codec": "fp32", **header,
    }  # fmt: skip
    return wire.pack(tensors, meta, key=signing.for_run(SECRET, syncer.run_id))


def verdict(store, syncer: Syncer, round_: int, lid: int, **claim) -> str:
    """What the syncer's intake makes of `lid`'s update to `round_`: "accepted" or the rejection reason."""
    store.put(keys.update_key(round_ % syncer.P, round_, lid, 0), update(syncer, round_, lid, **claim))
    rnd = syncer.rounds.open[round_]
    syncer.intake.collect(rnd)
    name = keys.update_key(round_ % syncer.P, round_, lid, 0).rsplit("/", 1)[-1]
    return rnd.rejected.get(name, "accepted" if f"{lid}-0" in rnd.answers else "unread")


def advance(store, syncer: Syncer, mono: Clock, wall: Clock, seconds: float) -> None:
    """Both clocks move `seconds` in 1 s steps, the learners heartbeating (so they stay live) and the syncer
    passing at each."""
    for _ in range(round(seconds)):
        mono.t += 1.0
        wall.t += 1.0
        for lid, c in enumerate(syncer.test_cadences):
            put_report(store, syncer, keys.report_key(lid, 0), report(lid, round(mono.t), wall(), wall_ema=c))
        syncer.step()


def publish_v1(store, syncer: Syncer, mono: Clock, wall: Clock) -> None:
    """Fragment 0 gets version 1 from an honest answer to round 0; then round 2 (fragment 0) opens 20 s
    later (on the syncer's steady clock: the claim bounds' clock)."""
    assert verdict(store, syncer, 0, 1, steps=16, seconds=0.5) == "accepted"
    syncer.step()  # quorum
    syncer.step()  # merge: version 1 published now
    assert syncer.versions[0] == 1
    advance(store, syncer, mono, wall, 20.0)
    for _ in range(200):
        mono.t += 0.1
        syncer.step()
        if 2 in syncer.rounds.open:
            return
    raise AssertionError("round 2 did not open")


@pytest.mark.parametrize("base", ["version_0", "published"])
def test_a_learner_with_the_run_key_claiming_a_million_steps_is_rejected(base):
    """10⁶ steps at exactly the batch's tokens per step, in 10 s of claimed compute (10 µs a step, the old
    floor): accepted before on any base, as the base's age was unchecked on version 0 and 20 s is more
    than 10 s on a published one. The fleet steps at 50 ms: 20-130 s allow a few thousand steps."""
    store, syncer, mono, wall = start(f"claims-million-{base}")
    round_ = 0
    if base == "published":
        publish_v1(store, syncer, mono, wall)
        round_ = 2
    assert syncer.versions[0] == (1 if base == "published" else 0)
    lie = {"steps": 10**6, "seconds": 10.0}
    assert verdict(store, syncer, round_, 0, **lie) == "future_steps"
    assert syncer.intake.rejected["future_steps"] == 1
    get = syncer.registry.get_sample_value
    assert get("ddiloco_syncer_rejected_updates_total", {"reason": "future_steps"}) == 1
    told = store.get_json(keys.STATUS)["rejections"]
    assert [(n["learner_id"], n["reason"]) for n in told] == [(0, "future_steps")]


def test_after_a_restart_the_newest_version_is_bounded_by_its_recorded_merge_time():
    """The run is 20 minutes old when fragment 0 gets version 1; a syncer restarted 20 s later did not
    publish it, but its round record says when it was merged: 10⁴ steps on it are rejected (the run's age
    alone would allow 190,000 at the fleet's pace)."""
    store, syncer, mono, wall = start("claims-restart")
    wall.t += 1100.0
    publish_v1(store, syncer, mono, wall)
    restarted = Syncer.open(store, clock=mono, wall=wall, secret=SECRET, poll_s=0)
    for _ in range(50):
        mono.t += 0.1
        restarted.step()
        frag0 = [s for s, rnd in restarted.rounds.open.items() if rnd.fragment_id == 0]
        if frag0:
            break
    assert restarted.versions[0] == 1 and 1 not in restarted.fragments[0].published_at
    assert verdict(store, restarted, frag0[0], 0, steps=10**4, seconds=19.0) == "future_steps"


def test_a_claim_of_a_billion_tokens_is_rejected():
    """10⁹ tokens at the batch's exact tokens per step (7.8 million steps) on version 0."""
    store, syncer, _, _ = start("claims-billion")
    steps = 10**9 // TPS
    assert verdict(store, syncer, 0, 0, steps=steps, seconds=steps * 1e-5) == "future_steps"


def test_tokens_per_step_must_be_the_learners_own_batch():
    """Learner 0 runs batch 4, learner 1 batch 16: learner 0 claiming learner 1's tokens per step (16²/4² =
    16× the weight per step) is bad_counters; so is a count that is no whole number of steps."""
    store, syncer, _, _ = start("claims-tps", "train.learner_batch_sizes=[4, 16]")
    assert verdict(store, syncer, 0, 0, steps=8, seconds=0.4, c_tokens=8 * 16 * 32) == "bad_counters"
    assert verdict(store, syncer, 0, 2, steps=8, seconds=0.4, c_tokens=8 * TPS - 1) == "bad_counters"
    assert verdict(store, syncer, 0, 1, steps=8, seconds=0.4, c_tokens=8 * 16 * 32) == "accepted"


def test_a_claim_three_times_faster_than_its_own_reported_cadence_is_rejected():
    """Learner 0 reports 1 s a step (the fleet's median is 50 ms): on a version published 20 s ago
    (20 × 1.05 + 1 = 22 s allowed) it may claim 66 steps, not 100."""
    store, syncer, mono, wall = start("claims-own", cadences=(1.0, STEP_S, STEP_S))
    publish_v1(store, syncer, mono, wall)
    assert verdict(store, syncer, 2, 0, steps=100, seconds=19.0) == "future_steps"
    assert verdict(store, syncer, 2, 2, steps=60, seconds=19.0) == "accepted"


def test_a_learner_ten_times_faster_than_the_rest_is_accepted_at_its_own_weight():
    """Learner 0 steps at 5 ms, the others at 50 ms (a faster device or a smaller batch): 2000 steps on a
    version published 20 s ago (22 s allowed, 13,200 at 3× its own cadence) are accepted and merged at its
    full token weight; the fleet's median bounds nobody (at 6e3bd56 anything above median / 8 = 6.25 ms a
    step was `future_steps`, and the share cap kept 2 median learners' weight)."""
    store, syncer, mono, wall = start("claims-fast", cadences=(0.005, STEP_S, STEP_S))
    publish_v1(store, syncer, mono, wall)
    assert verdict(store, syncer, 2, 0, steps=2000, seconds=19.0) == "accepted"
    syncer.step()
    syncer.step()
    syncer.rounds.commit_published(wait=True)  # another round is open: the publish ran beside the loop
    record = store.get_json(keys.round_record_key(2))
    assert record["contributors"]["0-0"]["weight"] == pytest.approx(2000 * TPS**2)
    assert record["contributors"]["0-0"]["c_tokens"] == 2000 * TPS


def test_each_step_is_credited_once_per_fragment():
    """Learner 1's answer to round 0 (steps 0..16 on version 0) merged: the same steps answered again, on
    the same base, to fragment 0's next round are `overlap` (at 6e3bd56: accepted, the tokens credited
    twice); new steps only (16..40) are accepted."""
    store, syncer, mono, wall = start("claims-overlap")
    publish_v1(store, syncer, mono, wall)
    again = {"steps": 16, "seconds": 0.5}
    assert verdict(store, syncer, 2, 1, **again, base_version=0) == "overlap"
    assert syncer.intake.rejected["overlap"] == 1
    mono.t += 1.1  # a rejected name is read again after a second, when its bytes changed
    verdict(store, syncer, 2, 1, steps=24, seconds=1.0, inner_step=40)
    assert "1-0" in syncer.rounds.open[2].answers


def test_a_step_of_the_hosts_wall_clock_moves_no_bound():
    """The wall clock steps 10 s back after version 1 is published (an NTP correction): an honest answer on
    it is still accepted (at 6e3bd56 ages were taken on the wall clock, and every answer on an older base
    was `future_steps`)."""
    store, syncer, mono, wall = start("claims-clock")
    publish_v1(store, syncer, mono, wall)
    wall.t -= 30.0
    assert verdict(store, syncer, 2, 0, steps=200, seconds=15.0) == "accepted"


@pytest.mark.parametrize("bad", [float("nan"), -1.0, -0.05, float("inf"), 1e9])
def test_an_unusable_step_wall_ema_does_not_steer_pacing(bad, caplog):
    """Learner 1 reports an unusable cadence: it is ignored (logged once, counted) and rounds open every
    (H/P) · 50 ms = 0.8 s, the honest learner's pace (a negative one opened a round on every pass, NaN
    never opened one)."""
    store = open_store("memory://claims-pacing")
    prepare(store, tiny_config("pace", "diloco.sync_every=32", "diloco.fragments=2", "diloco.overlap=2"))
    mono, wall = Clock(50.0), Clock(1_000_000.0)
    syncer = Syncer.open(store, clock=mono, wall=wall)
    put_report(store, syncer, keys.report_key(0, 0), report(0, 1, wall()))
    put_report(store, syncer, keys.report_key(1, 0), report(1, 1, wall(), wall_ema=bad))
    with caplog.at_level(logging.WARNING, logger="ddiloco.syncer.roster"):
        syncer.roster.refresh()
        put_report(store, syncer, keys.report_key(1, 0), report(1, 2, wall(), wall_ema=bad))
        syncer.roster.refresh()
        syncer.roster.refresh()  # the same report read again: not counted again
    assert syncer.xi_step() == pytest.approx(STEP_S)
    assert len([r for r in caplog.records if "step_wall_ema" in r.getMessage()]) == 1
    assert syncer.roster.ignored["step_wall_ema"] == 2
    get = syncer.registry.get_sample_value
    assert get("ddiloco_syncer_report_fields_ignored_total", {"field": "step_wall_ema"}) == 2
    assert len(syncer.roster.live()) == 2  # the rest of its report still counts: it is live
    syncer.rounds.maybe_open(mono())
    assert list(syncer.rounds.open) == [0]
    mono.t += 0.5
    syncer.rounds.maybe_open(mono())
    assert list(syncer.rounds.open) == [0]
    mono.t += 0.31
    syncer.rounds.maybe_open(mono())
    assert list(syncer.rounds.open) == [0, 1]


def test_every_number_the_syncer_reads_from_a_report_is_checked():
    good = report(3, 1, 10.0, fragments={"0": {"discarded_tokens": 5, "merged_seconds": 1.0}})
    assert reports.clean(good) == (good, [])
    bad = {
        **good, "step_time_ema": float("nan"), "loss_ema": float("inf"), "tokens_processed": -4, "seq": 1e300,
        "productive_seconds": -1.0, "joined_at": float("nan"), "tokens_per_s": -1.0, "mfu": 1e9,
        "peak_flops": 0.0, "fragments": {"0": {"discarded_tokens": float("nan"), "merged_seconds": -2.0}},
    }  # fmt: skip
    cleaned, dropped = reports.clean(bad)
    assert sorted(dropped) == sorted([
        "step_time_ema", "loss_ema", "tokens_processed", "seq", "productive_seconds", "joined_at",
        "tokens_per_s", "mfu", "peak_flops", "fragments.0.discarded_tokens", "fragments.0.merged_seconds",
    ])  # fmt: skip
    assert cleaned["fragments"]["0"] == {"discarded_tokens": 0, "merged_seconds": 0.0}
    assert cleaned["step_time_ema"] is None and cleaned["step_wall_ema"] == STEP_S
    assert bad["step_time_ema"] != bad["step_time_ema"]  # the report read is left as it was
    assert not reports.times_finite({**good, "time": float("nan")})


def test_the_credit_book_survives_a_syncer_restart():
    """The merged ends are in the syncer's state: after a restart the same steps are still `overlap`."""
    store, syncer, mono, wall = start("claims-restart-book")
    publish_v1(store, syncer, mono, wall)
    syncer.save_state()
    assert store.get_json(keys.SYNCER_STATE)["credited_steps"] == {"1-0/0": 16}
    restarted = Syncer.open(store, clock=mono, wall=wall, secret=SECRET, poll_s=0)
    restarted.test_cadences = syncer.test_cadences
    advance(store, restarted, mono, wall, 3.0)
    frag0 = [s for s, rnd in restarted.rounds.open.items() if rnd.fragment_id == 0]
    assert (
        frag0 and verdict(store, restarted, frag0[0], 1, steps=16, seconds=0.5, base_version=0) == "overlap"
    )


def test_a_new_incarnation_inherits_its_learners_cadence():
    """Learner 0 reported 1 s a step; its incarnation 1 joins and, before it reported a cadence of its own,
    claims 100 steps on version 1: bounded by its learner's cadence (3 × ~11.5 s allowed since it was heard
    of: 34 steps), `future_steps`; without the inheritance only the FLOPs floor would have bounded it."""
    store, syncer, mono, wall = start("claims-inherit", cadences=(1.0, STEP_S, STEP_S))
    publish_v1(store, syncer, mono, wall)
    fresh = report(0, 1, wall(), inc=1) | {"incarnation": 1, "step_wall_ema": None, "step_time_ema": None}
    put_report(store, syncer, keys.report_key(0, 1), fresh)
    mono.t += 0.6
    syncer.step()  # the roster reads incarnation 1's report
    blob = update(syncer, 2, 0, steps=100, seconds=10.0, incarnation=1)
    store.put(keys.update_key(0, 2, 0, 1), blob)
    syncer.intake.collect(syncer.rounds.open[2])
    assert syncer.rounds.open[2].rejected.get("000-0001.safetensors") == "future_steps"
