"""Hostile and broken objects injected into live in-process runs (issue 9: trust on the wire).

The runs are deterministic: one thread, the learners' I/O pools replaced by an inline executor, no status
poller thread, a syncer clock that advances one "second" per iteration, K = M = 2 and no grace window. Two
clean runs are then bitwise identical, so "the injected objects changed nothing" is checked bitwise.
Robust mode is different by design (a clipped outlier is still merged), so it is checked against a
tolerance, next to a control run that shows what the same outlier does without it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import pytest
import torch

from ddiloco import keys
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import signing, wire
from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.wire import RunSigner
from ddiloco.run.globalmodel import publish_global, read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import status as empty_status
from tests._harness import tiny_config

SECRET = bytes.fromhex("5a" * 32)
DETERMINISTIC = (
    "diloco.quorum=2",
    "diloco.grace=null",
    "diloco.round_timeout_s=1e9",
    "train.checkpoint_every_s=1e9",
    "train.heartbeat_every_s=5",
    "diloco.token_budget=6000",
    "retention.keep_latest=2",  # the tightest retention: honest answers still all merge, and a base older
    "retention.curve_moments=2",  # than the window (no curve moment pins it) is `pruned_base`
)


class Inline(Executor):
    """Runs every submitted call at once, on the caller's thread."""

    def submit(self, fn, /, *args, **kwargs):
        fut: Future = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # the learner inspects the future, exactly as with a thread pool
            fut.set_exception(e)
        return fut


@dataclass
class Run:
    name: str
    store: Store
    syncer: Syncer
    learners: list[Learner]
    now: list[float]
    final: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def key(self) -> bytes:
        return signing.for_run(SECRET, self.name)


Hook = Callable[[Run, int], None]


def start(name: str, *overrides: str, robust=None, learners: int = 2) -> Run:
    """Prepared store, syncer and started learners, set up to be driven deterministically."""
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, *DETERMINISTIC, *overrides), secret=SECRET)
    now = [0.0]
    syncer = Syncer.open(  # passes in lock step with the learners: a run repeats bit for bit
        store, poll_s=0, clock=lambda: now[0], secret=SECRET, robust_clip=robust, publish_beside=False
    )
    r = Run(name, store, syncer, [Learner.open(store, i, secret=SECRET) for i in range(learners)], now=now)
    for learner in r.learners:
        learner.pool.shutdown()
        learner.pool = Inline()
        learner.poller.start = lambda: None  # polled by the driver only, between steps
        learner.start()
    return r


def tick(r: Run) -> None:
    for learner in r.learners:
        learner.poller.poll_once()
        learner.tick()


def first_round(r: Run) -> int:
    """Tick the learners until the syncer opens its first round (once it knows their cadence); its number."""
    for _ in range(50):
        r.now[0] += 1.0
        r.syncer.step()
        if r.syncer.rounds.open:
            (s,) = r.syncer.rounds.open
            return s
        tick(r)
    raise AssertionError("no round opened")


def run(
    name: str,
    *overrides: str,
    before: Hook | None = None,
    after: Hook | None = None,
    robust=None,
    learners: int = 2,
    steps: tuple[int, ...] | None = None,
    passes: int = 5000,
) -> Run:
    """A deterministic in-process run; `before` sees each round right after the syncer opened it (before
    the learners answer), `after` sees the store after the learners' ticks; `steps`: ticks of each learner
    per pass of the syncer (one each by default: a learner with 10 is 10× faster on the syncer's clock)."""
    r = start(name, *overrides, robust=robust, learners=learners)
    opened: set[int] = set()
    for _ in range(passes):
        r.now[0] += 1.0
        if r.syncer.step():
            for learner in r.learners:
                learner.poller.poll_once()
                assert learner.tick() is False
                learner.close("done")
            break
        for rnd in sorted(set(r.syncer.rounds.open) - opened):
            opened.add(rnd)
            if before is not None:
                before(r, rnd)
        for learner, n in zip(r.learners, steps or (1,) * len(r.learners), strict=True):
            for _ in range(n):
                learner.poller.poll_once()
                learner.tick()
        if after is not None:
            after(r, max(opened, default=-1))
    else:
        raise AssertionError("the run did not finish")
    model = RunRoot(r.store, name, r.key).final_model(read_layout(r.store))
    r.final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return r


def fake_update(r: Run, round_: int, learner_id: int, *, key=..., seed=0, edit=None, **header) -> bytes:
    """A well-formed, signed update from a learner id the run does not have, unless `edit`/`header` break it."""
    layout, p = r.syncer.layout, round_ % r.syncer.P
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        f"{n}/data": 1e-3 * torch.randn(math.prod(layout.shapes[n]), generator=gen)
        for n in layout.fragments[p].names
    }
    if edit is not None:
        edit(tensors)
    meta = {
        "run_id": r.name, "kind": "update", "learner_id": learner_id, "incarnation": 0, "fragment_id": p,
        "round": round_, "base_version": r.syncer.versions[p], "c_steps": 4, "c_tokens": 4 * 128,
        "c_seconds": 0.05, "inner_step": 10, "codec": "fp32", **header,
    }  # fmt: skip
    return wire.pack(tensors, meta, key=r.key if key is ... else key)


def put(r: Run, round_: int, name: str, blob: bytes) -> None:
    r.store.put(keys.update_prefix(round_ % r.syncer.P, round_) + name, blob)


def _first_nan(t: dict[str, torch.Tensor]) -> None:
    next(iter(t.values()))[0] = float("nan")


def _shorter(t: dict[str, torch.Tensor]) -> None:
    k = next(iter(t))
    t[k] = t[k][:-1]


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a), "the final model differs"


def rel_distance(
    x: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], init: dict[str, torch.Tensor]
) -> float:
    """‖x − ref‖ / ‖ref − init‖ over all parameters: 0 = identical, 1 = as far as training moved the model."""
    num = sum(float((x[n] - ref[n]).double().pow(2).sum()) for n in ref)
    den = sum(float((ref[n] - init[n]).double().pow(2).sum()) for n in ref)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def reference() -> tuple[Run, bytes]:
    """The clean run, and one real update it produced (a valid object from another run)."""
    captured: dict[str, bytes] = {}

    def grab(r: Run, _: int) -> None:
        key = keys.update_key(1, 1, 0, 0)
        if "blob" not in captured and r.store.exists(key):
            captured["blob"] = r.store.get(key)

    ref = run("inj-ref", after=grab)
    assert ref.syncer.intake.rejected == Counter() and ref.syncer.books.clipped == Counter()
    return ref, captured["blob"]


def test_injected_objects_are_counted_by_reason_and_change_nothing(reference):
    ref, foreign = reference
    own: dict[str, bytes] = {}
    other_key = signing.for_run(b"\x01" * 32, "inj-live")
    rng = random.Random(0)
    # round -> [(name, object, reason)]; rounds alternate fragments (p = round mod 2)
    plan: dict[int, Callable[[Run, int], list[tuple[str, bytes, str]]]] = {
        2: lambda r, s: [
            ("090-0000.safetensors", bytes(rng.randrange(256) for _ in range(300)), "malformed"),
            ("091-0000.safetensors", fake_update(r, s, 91)[:400], "truncated"),
        ],
        3: lambda r, s: [
            ("092-0000.safetensors", foreign, "foreign_run"),  # learner 0's real round-1 update of inj-ref
            ("093-0000.safetensors", fake_update(r, s, 93, key=None), "unsigned"),
            ("094-0000.safetensors", fake_update(r, s, 94, key=other_key), "bad_signature"),
        ],
        4: lambda r, s: [
            ("095-0000.safetensors", fake_update(r, s, 95, edit=_first_nan), "non_finite"),
            ("096-0000.safetensors", fake_update(r, s, 96, edit=_shorter), "wrong_shape"),
            ("097-0000.safetensors", b"\0" * (2 * 4 * r.syncer.layout.fragments[0].numel + (1 << 20) + 1), "too_large"),
        ],
        5: lambda r, s: [  # learner 0's round-1 update (same fragment) copied into round 5 under another name
            ("000-0009.safetensors", own["round1"], "replay"),
        ],
        6: lambda r, s: [
            ("098-0000.safetensors", fake_update(r, s, 98, codec="int8"), "bad_codec"),
            ("099-0000.safetensors", fake_update(r, s, 99, c_tokens=4 * 128 + 1), "bad_counters"),
        ],
        7: lambda r, s: [
            ("100-0000.safetensors", fake_update(r, s, 100, c_steps=10**6, c_tokens=128, inner_step=10**6), "future_steps"),
            ("101-0000.safetensors", fake_update(r, s, 101, base_version=r.syncer.versions[1] + 5), "bad_base"),
            # a kind the syncer signs, found where learners' answers go: judged by a learner's signature
            ("102-0000.safetensors", fake_update(r, s, 102, kind="global"), "bad_signature"),
            ("103-0000.safetensors", fake_update(r, s, 103, base_version=1), "pruned_base"),
        ],
    }  # fmt: skip
    injected: dict[int, dict[str, str]] = {}

    def before(r: Run, s: int) -> None:
        if s in plan:
            injected[s] = {}
            for name, blob, reason in plan[s](r, s):
                put(r, s, name, blob)
                injected[s][name] = reason
        if s == 5:  # and the same update again under its own, already merged, round 1
            r.store.put(keys.update_key(1, 1, 0, 0), own["round1"])

    def after(r: Run, _: int) -> None:
        key = keys.update_key(1, 1, 0, 0)
        if "round1" not in own and r.store.exists(key):
            own["round1"] = r.store.get(key)

    live = run("inj-live", before=before, after=after)

    assert_bitwise_equal(live.final, ref.final)
    expected = Counter(reason for objs in injected.values() for reason in objs.values())
    expected["replay"] += 1  # the copy under its own merged round, found by the sweep after the next merge
    assert live.syncer.intake.rejected == expected
    for s, objs in injected.items():  # each object under its own reason, in its round's record
        assert live.store.get_json(keys.round_record_key(s))["rejected"] == objs
    summary = build_summary(live.store)
    assert summary.rejected_updates == dict(expected)
    assert summary.ledger_balanced and summary.global_versions == build_summary(ref.store).global_versions
    get = live.syncer.registry.get_sample_value
    for reason, n in expected.items():
        assert get("ddiloco_syncer_rejected_updates_total", {"reason": reason}) == n
    # Authentic updates of a (fake) learner are answered with a notice; unattributable junk is not.
    told = {(n["learner_id"], n["reason"]) for n in live.store.get_json(keys.STATUS)["rejections"]}
    assert told == {(95, "non_finite"), (96, "wrong_shape"), (98, "bad_codec"), (99, "bad_counters"),
                    (100, "future_steps"), (101, "bad_base"), (103, "pruned_base")}  # fmt: skip
    assert all(
        not learner.exchange.rejected_updates and not learner.feed.rejected_globals
        for learner in live.learners
    )


def test_the_equality_check_has_teeth(reference):
    """Control: one well-formed update from an extra learner id, accepted, visibly changes the final model."""
    ref, _ = reference

    def before(r: Run, s: int) -> None:
        if s == 4:
            put(r, s, "095-0000.safetensors", fake_update(r, s, 95))

    control = run("inj-control", before=before)
    assert control.syncer.intake.rejected == Counter()
    assert not all(torch.equal(control.final[n], ref.final[n]) for n in ref.final)


def copies_of_learner0(scale: float, rounds: tuple[int, ...]) -> Hook:
    """After learner 0 answered round s, file `scale` × its delta as the answer of learner 90 + s."""

    def after(r: Run, _: int) -> None:
        for s in rounds:
            key = keys.update_key(s % r.syncer.P, s, 0, 0)
            name = f"{90 + s:03d}-0000.safetensors"
            if r.store.exists(key) and not r.store.exists(keys.update_prefix(s % r.syncer.P, s) + name):
                src = wire.unpack(r.store.get(key), expect={"kind": "update"}, key=r.key)
                tensors = {n: scale * t for n, t in src.tensors.items()}
                put(r, s, name, wire.pack(tensors, {**src.meta, "learner_id": 90 + s}, key=r.key))

    return after


def test_robust_mode_clips_a_ten_times_outlier(reference):
    """An answer 10× the median norm (10 × learner 0's own update, in three rounds): clipped to 2× the
    median in robust mode, still merged, counted under `clipped`.

    Tolerance. Robust mode bounds an outlier's norm; it cannot make it vanish. So the bound is calibrated
    in the same deterministic setting: `honest` adds, in the same rounds, a 1× copy of learner 0's update
    (an extra learner that agrees with it). A clipped outlier has twice that norm, so it may move the model
    up to 3× as far as `honest` (measured: ~1.7×; both ~0.05-0.08 of the distance training moved the
    model, less than the 0.07-0.17 spread between two clean runs in normal threaded mode). The control
    without robust mode is ≥ 4× further again (measured ~6.7×; ~0.55 of the training distance).
    """
    ref, _ = reference
    init = {
        n: p.detach().clone() for n, p in Learner.open(ref.store, 50, secret=SECRET).model.named_parameters()
    }
    rounds = (4, 9, 14)

    clean = run("rob-clean", robust=2.0)
    assert_bitwise_equal(clean.final, ref.final)  # two honest answers are never clipped at 2× median
    honest = run("rob-honest", after=copies_of_learner0(1.0, rounds), robust=2.0)
    robust = run("rob-live", after=copies_of_learner0(10.0, rounds), robust=2.0)
    control = run("rob-control", after=copies_of_learner0(10.0, rounds))

    assert honest.syncer.books.clipped == Counter() and control.syncer.books.clipped == Counter()
    assert robust.syncer.books.clipped == Counter(norm_outlier=len(rounds))
    assert robust.syncer.intake.rejected == Counter()
    for s in rounds:
        (factor,) = robust.store.get_json(keys.round_record_key(s))["clipped"].values()
        assert 0.15 < factor < 0.25  # 10× the median cut to 2×
    get = robust.syncer.registry.get_sample_value
    assert get("ddiloco_syncer_clipped_updates_total", {"reason": "norm_outlier"}) == len(rounds)
    assert robust.store.get_json(keys.STATUS)["clipped"] == {"norm_outlier": len(rounds)}
    d_honest, d_robust, d_control = (
        rel_distance(x.final, ref.final, init) for x in (honest, robust, control)
    )
    assert 0 < d_robust <= 3 * d_honest, (d_robust, d_honest)
    assert d_control >= 4 * d_robust, (d_control, d_robust)


# --- the other side of each rule: what learners, the syncer and prepare do with bad objects -------------------
def test_junk_filed_under_a_learners_name_does_not_block_its_answer():
    r = start("bad-junk", "diloco.quorum=1", learners=1)
    s = first_round(r)
    key = keys.update_key(s % r.syncer.P, s, 0, 0)
    r.store.put(key, b"junk" * 50)  # written before the learner's own answer
    for _ in range(3):  # looked at again once a second, counted once: the bytes did not change
        r.now[0] += 1.0
        r.syncer.step()
    assert r.syncer.intake.rejected == Counter(malformed=1)
    tick(r)  # one step (a learner answers once it has stepped) ...
    tick(r)  # ... then its answer replaces the junk
    for _ in range(2):  # read and accepted, then merged
        r.now[0] += 1.0
        r.syncer.step()
    rec = r.store.get_json(keys.round_record_key(s))
    assert list(rec["contributors"]) == ["0-0"] and rec["rejected"] == {"000-0000.safetensors": "malformed"}
    assert r.store.get_json(keys.STATUS)["rejections"] == []  # junk is nobody's: no learner is told
    tick(r)
    assert r.learners[0].exchange.rejected_updates == Counter()


def test_a_learner_is_told_when_its_answer_is_rejected_and_its_tokens_stay_outstanding():
    r = start("bad-told", "diloco.quorum=1")
    bad = r.learners[0]
    bad.cfg.diloco.codec = "bf16"  # a learner deployed with another codec than the run's fp32
    for _ in range(400):
        r.now[0] += 1.0
        if r.syncer.step():
            break
        tick(r)
        latest = bad.poller.latest  # None until the first round opened (after the cadence is known)
        told = {n.round for n in latest.rejections if n.learner_id == 0} if latest else set()
        assert not any(fs.pending and fs.pending.round in told for fs in bad.ledger)  # dropped once told
    for learner in r.learners:
        learner.poller.poll_once()
        learner.tick()
        learner.close("done")
    assert r.syncer.intake.rejected["bad_codec"] == bad.exchange.rounds_answered > 0
    assert bad.exchange.rejected_updates == Counter(bad_codec=bad.exchange.rounds_answered)
    assert r.learners[1].exchange.rejected_updates == Counter()
    report = r.store.get_json(keys.report_key(0, 0))
    assert report["rejected_updates"] == {"bad_codec": bad.exchange.rounds_answered}
    assert sum(f["merged_tokens"] for f in report["fragments"].values()) == 0
    assert (
        bad.registry.get_sample_value(
            "ddiloco_learner_rejected_total", {"learner_id": "0", "kind": "update", "reason": "bad_codec"}
        )
        == bad.exchange.rounds_answered
    )
    summary = build_summary(r.store)
    assert summary.ledger_balanced and summary.rejected_updates == {"bad_codec": bad.exchange.rounds_answered}


LIE = 5000


def test_a_lying_learner_with_the_run_key_is_rejected_and_the_ledger_stays_balanced():
    """Learner 0 holds the run key and, once the syncer knows the learners' cadence, multiplies the steps and
    tokens it claims by 5000 (its inner step counter too, so its answers agree with one another; c_seconds
    at the 10 µs a step the old floor accepted): the measured attack, which took a round's weight and ended
    the run early on tokens never trained. Every such answer is rejected `future_steps` (steps since its
    base at the fleet's pace, `ddiloco.protocol.claims`), learner 0 is told and keeps its tokens
    outstanding, the run reaches its budget on honest answers and both books agree."""
    r = start("bad-liar", "diloco.quorum=1", "diloco.token_budget=3000")
    liar = r.learners[0]
    honest_header = liar.exchange._header

    def inflated(p: int, round_: int, inner_step: int) -> UpdateHeader:
        h = honest_header(p, round_, inner_step)
        h.c_steps, h.c_tokens, h.inner_step = h.c_steps * LIE, h.c_tokens * LIE, inner_step * LIE
        h.c_seconds = max(h.c_seconds, h.c_steps * 1e-5)
        return h

    lying_from = None
    for _ in range(1000):
        r.now[0] += 1.0
        if r.syncer.step():
            break
        tick(r)
        if lying_from is None and liar.cadence.ema is not None:  # reported: the syncer reads it next pass
            lying_from = r.syncer.books.next_round
            liar.exchange._header = inflated
    for learner in r.learners:
        learner.poller.poll_once()
        learner.tick()
        learner.close("done")
    assert lying_from is not None, "learner 0 never measured its cadence"
    lies = liar.exchange.rejected_updates["future_steps"]
    assert lies > 0 and r.syncer.intake.rejected == Counter(future_steps=lies)
    records = [r.store.get_json(keys.round_record_key(s)) for s in range(r.syncer.books.next_round)
               if r.store.exists(keys.round_record_key(s))]  # fmt: skip
    assert all(c["c_steps"] < LIE for rec in records for c in rec["contributors"].values())
    assert not any("0-0" in rec["contributors"] for rec in records if rec["round"] >= lying_from)
    summary = build_summary(r.store)
    budget = r.syncer.cfg.diloco.token_budget
    assert summary.ledger_balanced and budget <= summary.tokens_merged < 2 * budget


def test_an_answer_too_far_behind_is_rejected_as_too_stale_and_one_within_reach_is_discounted():
    """Issue 17 item 5: with diloco.max_staleness=1, an (authentic, fake-learner) answer 2 versions behind is
    rejected as too_stale before its base is read, and its learner is told; one 1 version behind is merged
    with its staleness and discount (1 + 1)^-0.5 in the round record."""
    seen: dict[str, int] = {}

    def before(r: Run, s: int) -> None:
        v = r.syncer.versions[s % r.syncer.P]
        if s >= 6 and v >= 2 and not seen:
            seen.update(round=s, version=v)
            put(r, s, "103-0000.safetensors", fake_update(r, s, 103, base_version=v - 2))
            put(r, s, "104-0000.safetensors", fake_update(r, s, 104, base_version=v - 1))

    r = run("bad-stale", "diloco.max_staleness=1", before=before)
    assert seen, "the run never reached a fragment version 2"
    assert r.syncer.intake.rejected == Counter(too_stale=1)
    record = r.store.get_json(keys.round_record_key(seen["round"]))
    assert record["rejected"] == {"103-0000.safetensors": "too_stale"}
    stale = record["contributors"]["104-0"]
    assert (stale["staleness"], stale["base_version"]) == (1, seen["version"] - 1)
    assert stale["discount"] == pytest.approx(2**-0.5)
    assert all(c["discount"] == 1.0 for n, c in record["contributors"].items() if n != "104-0")
    told = {(n["learner_id"], n["reason"]) for n in r.store.get_json(keys.STATUS)["rejections"]}
    assert told == {(103, "too_stale")}
    assert build_summary(r.store).rejected_updates == {"too_stale": 1}


def _forge_global(r: Run, p: int, version: int, key=None) -> None:
    """An unsigned (or wrongly signed) global version with the right shapes, named by latest and status."""
    layout = r.syncer.layout
    tensors = {n: torch.zeros(layout.shapes[n]) for n in layout.fragments[p].names}
    publish_global(r.store, RunSigner(r.name, key), p, version, tensors, "fp32")


def test_a_learner_skips_a_global_version_that_fails_verification_and_keeps_training():
    r = start("bad-global", learners=1)
    learner = r.learners[0]
    tick(r)
    status = (
        r.store.get_json(keys.STATUS)
        if r.store.exists(keys.STATUS)
        else empty_status(run_id=r.name).to_json()
    )
    _forge_global(r, 0, 1)
    forged_status = {**status, "versions": {"0": 1, "1": 0}, "open_rounds": [], "merged": []}
    r.store.put_json(keys.STATUS, signing.sign_doc(forged_status, r.key, signing.SYNCER))
    steps = learner.inner_step
    before = {n: t.clone() for n, t in learner.params.items()}
    for _ in range(3):
        tick(r)  # the forged version is tried once, refused, never retried
    assert learner.inner_step == steps + 3 and learner.ledger[0].anchor == 0
    assert learner.feed.rejected_globals == Counter(unsigned=1)
    assert not any(
        torch.equal(learner.params[n], torch.zeros_like(t)) for n, t in before.items() if t.numel() > 1
    )
    learner._put_report()
    assert r.store.get_json(keys.report_key(0, 0))["rejected_globals"] == {"unsigned": 1}


def test_roles_start_from_the_newest_version_that_verifies():
    r = start("bad-latest", learners=0)
    _forge_global(r, 1, 1, key=signing.for_run(b"\x02" * 32, "bad-latest"))  # signed, with another key
    learner = Learner.open(r.store, 0, secret=SECRET)
    learner.start()
    assert [fs.anchor for fs in learner.ledger] == [0, 0]
    assert learner.feed.rejected_globals == Counter(bad_signature=1)
    assert Syncer.open(r.store, secret=SECRET).versions == [0, 0]  # a restarted syncer does not adopt it
    learner.close("max_steps")


def test_a_tampered_checkpoint_is_not_loaded():
    from ddiloco.learner.checkpoint import save_learner_checkpoint

    r = start("bad-ckpt", learners=1)
    a = r.learners[0]
    for _ in range(3):
        tick(r)
    meta = {"run_id": r.name, "cursor": a.loader.state_dict(), "incarnation": 0}
    save_learner_checkpoint(RunRoot(r.store, r.name), 0, a.inner_step, a.model, a.opt, meta)  # unsigned
    b = Learner.open(r.store, 0, secret=SECRET)
    b.start()
    assert b.inner_step == 0 and not b.opt.state  # fresh, from the current globals
    b.close("max_steps")


def test_prepare_refuses_a_store_prepared_with_another_secret():
    from ddiloco.errors import ConfigError

    r = start("bad-secret", learners=0)
    cfg = tiny_config("bad-secret", *DETERMINISTIC)
    prepare(r.store, cfg, secret=SECRET)  # same secret: idempotent
    with pytest.raises(ConfigError, match="prepared with another DDILOCO_RUN_KEY"):
        prepare(r.store, cfg, secret=b"\x03" * 32)
