"""Chaos with real processes and real signals: SIGKILL, SIGSTOP/SIGCONT, a killed syncer, an outage."""

import pytest

from ddiloco import keys
from ddiloco.launch import LocalRun
from ddiloco.protocol import wire
from ddiloco.run.globalmodel import latest_version
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = pytest.mark.slow

BASE = ("diloco.learners=4", "diloco.fragments=2", "diloco.token_budget=400000", "train.checkpoint_every_s=2")
# Timed events (at_s) need a run that outlasts them, on a fast quiet machine as on a loaded one: a token
# budget cannot promise that (800k tokens took under 25 s on a fast machine and found a kill at 25 s too late;
# 2M tokens took 250-290 s each on a loaded 2-core CI machine). The deadline (`diloco.deadline_s`, counted
# from prepare like the events) ends these runs at a fixed time whatever the machine's speed: 14-35 s after
# the last event, as much as what is checked after it needs (a restarted syncer: a process start, which takes
# up to ~29 s on a loaded 2-core machine; a stalled learner: nothing after SIGCONT).


def outlasts_timed_events(deadline_s: int) -> tuple[str, ...]:
    return ("diloco.token_budget=1000000000", f"diloco.deadline_s={deadline_s}", "sft=null")


# The loss comparison also needs a corpus the run does not cycle through (the harness's 600 documents are
# seen many times over in 800k tokens, and the loss then depends on timing), more than 2 validation
# batches, and more than one point: this tiny model plateaus near 0.8 after ~500k tokens, and there the
# global model's loss moves by ±5% from one published version to the next in every run (a clean run's
# last three curve points: 0.811, 0.835, 0.871). The plateau level is the mean of the last three points.
# H = 16 keeps these two runs from being syncer-bound (with H = 4 most steps land while a round is in
# flight, and the loss then depends on how fast the syncer happens to be).
# 1.6M tokens: a killed learner is away ~9 s per kill (restart back-off + interpreter start), so the run
# must be long for two kills to cost the others little compute (at 800k: +2.8% final, +3.0% plateau).
MEASURED = ("data.synthetic_docs=20000", "eval.val_batches=128", "eval.curve_points=8", "sft=null",
            "diloco.sync_every=16", "diloco.token_budget=1600000")  # fmt: skip


def plateau_loss(store) -> float:
    points = store.get_json("eval/curve.json")["points"]
    assert len(points) >= 6, points
    return sum(p["val_loss"] for p in points[-3:]) / 3


def run_with(tmp_path, run_id, *overrides, timeout=600):
    run = LocalRun(tiny_config(run_id, *BASE, *overrides), tmp_path)
    return run, run.run(timeout=timeout)


def round_records(store):
    return [store.get_json(k) for k in store.list("syncer/rounds/")]


def assert_no_lost_or_double_merges(store, summary):
    """Check through the store's objects: one round record per published version, ledger = records."""
    records = round_records(store)
    P = summary.num_fragments
    for p in range(P):
        versions = sorted(r["version"] for r in records if r["fragment_id"] == p)
        assert versions == list(range(1, latest_version(store, p) + 1)), f"fragment {p}: {versions}"
        kept = keys.global_versions_listed(store.list(keys.global_prefix(p)), P)[p]
        assert latest_version(store, p) in kept and len(kept) <= 16  # retention (issue 16) prunes the rest
        for r in records:
            if r["fragment_id"] == p and r["version"] in kept:
                header = wire.unpack(store.get(keys.global_key(p, r["version"])))
                assert header.meta["round"] == r["round"], "each version comes from exactly its round"
    per_frag = [
        sum(c["c_tokens"] for r in records if r["fragment_id"] == p for c in r["contributors"].values())
        for p in range(P)
    ]
    assert per_frag == summary.tokens_merged_per_fragment
    assert summary.ledger_balanced


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run, s = run_with(tmp_path_factory.mktemp("ref"), "ref", *MEASURED)
    return s, plateau_loss(open_store(run.url))


KILL_TWICE = "chaos.events=[{kind: kill_learner, learner: 1, at_step: 300}, {kind: kill_learner, learner: 1, at_step: 800}]"
# Kills at inner steps (the learner SIGKILLs itself, once per event) land after it joined, however slowly
# the machine starts processes; the timed kills of the launcher are covered by the syncer test.


def check_killed_twice(run, s) -> None:
    """The books of a run whose learner 1 was SIGKILLed twice: both kills fired, it came back twice, nothing
    merged twice or lost, the syncer never stalled, every kill was recovered from."""
    store = open_store(run.url)
    assert s.status == "done"
    fired = [e for e in s.chaos_events if e.get("action") == "SIGKILL (self)"]
    assert [e["learner"] for e in fired] == [1, 1], s.chaos_events
    assert s.incarnations["1"] == 3 and s.incarnations["0"] == 1
    assert s.tokens_processed == s.tokens_merged + s.tokens_discarded and s.tokens_outstanding == 0
    assert_no_lost_or_double_merges(store, s)
    merged_at = sorted(r["merged_at"] for r in round_records(store))
    gap = max(b - a for a, b in zip(merged_at, merged_at[1:], strict=False))
    assert gap < 20 * s.learner_step_seconds + 1.0, f"the syncer stalled for {gap:.2f}s"
    assert all(k["rejoin_seconds"] is not None for k in s.kill_recovery), s.kill_recovery
    # Each restart resumed its data after the last batch its predecessor reported, not at its checkpoint.
    assert s.tokens_read_twice == 0, s.learner_accounting
    assert s.final_val_loss < s.initial_val_loss / 3  # it learned (800k tokens: 5.54 -> 1.52)


def test_killing_one_learner_twice(tmp_path):
    # The books only, at 800k tokens (~1,500 steps per learner: both kills land); what the kills cost in
    # loss against a run without them is the `long` test below (two 1.6M-token runs, ~230 s of CI).
    budget = "diloco.token_budget=800000"
    run, s = run_with(tmp_path, "kill2", "sft=null", "diloco.sync_every=16", budget, KILL_TWICE)
    check_killed_twice(run, s)


@pytest.mark.long
def test_killing_one_learner_twice_costs_under_5_percent_of_the_loss(tmp_path, reference):
    run, s = run_with(tmp_path, "kill2", *MEASURED, KILL_TWICE)
    check_killed_twice(run, s)
    # The criterion: final validation loss within 5% of the run without chaos (128 validation
    # batches). The plateau level is reported next to it: in three clean-clone pairs the final ratio was
    # 0.97 / 1.028 / 1.009 and the plateau ratio 1.019 / 1.030 / 1.057 (the plateau averages points from
    # before the killed learner's absences were made up, so it runs ~3% behind).
    (ref, ref_plateau), plateau = reference, plateau_loss(open_store(run.url))
    assert s.final_val_loss <= ref.final_val_loss * 1.05, (
        s.final_val_loss, ref.final_val_loss, plateau, ref_plateau,
    )  # fmt: skip


# One run, three disruptions one after another, each checked in its own window: a stalled learner (5-17 s), a
# store outage (22-32 s) and a killed syncer (38 s; its restart takes up to ~29 s on a loaded 2-core machine).
# They were three runs (~160 s of the suite); none of them changes what is checked about another one: the
# stall is over before the outage, the outage before the kill, and the books are checked once for all three.
STALL_AT, STALL_S, OUTAGE_AT, OUTAGE_S, KILL_AT = 5, 12, 22, 10, 38
THREE_DISRUPTIONS = (
    "chaos.events=["
    f"{{kind: stall_learner, learner: 2, at_s: {STALL_AT}, duration_s: {STALL_S}}}, "
    f"{{kind: store_outage, at_s: {OUTAGE_AT}, duration_s: {OUTAGE_S}}}, "
    f"{{kind: kill_syncer, at_s: {KILL_AT}}}]"
)


@pytest.fixture(scope="module")
def disrupted(tmp_path_factory):
    run, s = run_with(
        tmp_path_factory.mktemp("disrupted"),
        "disrupted",
        *outlasts_timed_events(KILL_AT + 35),
        THREE_DISRUPTIONS,
    )
    store = open_store(run.url)
    fired = {e["action"]: e["fired_at"] for e in s.chaos_events}
    return s, store, fired, run.logdir


def why_restarted(logdir) -> str:
    """The lines of the learners' logs that say why one exited (for an assertion's message)."""
    said = []
    for log in sorted(logdir.glob("learner-*.log")):
        lines = log.read_text(errors="replace").splitlines()
        said += [f"{log.name}: {line}" for line in lines if "error" in line.lower() or "Traceback" in line]
    return "\n".join(said[-20:])


def test_the_run_survives_a_stall_an_outage_and_a_killed_syncer_with_its_books_balanced(disrupted):
    s, store, _, logdir = disrupted
    assert s.status == "done" and s.finished_by == "deadline" and s.ledger_balanced
    assert s.global_versions_contiguous
    assert_no_lost_or_double_merges(store, s)
    assert sum(s.incarnations.values()) == 4, f"a learner was restarted: {why_restarted(logdir)}"


def test_a_stalled_learner_does_not_hold_back_the_others(disrupted):
    s, store, fired, logdir = disrupted
    assert [e["action"] for e in s.chaos_events if e["action"].startswith("SIG")][:2] == [
        "SIGSTOP",
        "SIGCONT",
    ]
    start = fired["SIGSTOP"]
    during = [r for r in round_records(store) if start + 1 < r["merged_at"] < start + STALL_S - 1]
    assert len(during) >= STALL_S - 2, f"only {len(during)} merges while learner 2 was stopped"
    assert all("2-0" not in r["contributors"] for r in during[5:]), "the stalled learner cannot answer"
    assert s.incarnations["2"] == 1, why_restarted(logdir)


def test_a_store_outage_is_ridden_out(disrupted):
    s, store, _, _ = disrupted
    start = next(e["fired_at"] for e in s.chaos_events if e["kind"] == "store_outage")
    merged_at = [r["merged_at"] for r in round_records(store)]
    assert not [t for t in merged_at if start + 0.5 < t < start + OUTAGE_S - 0.5], (
        "nothing can merge while the store is down"
    )
    assert [t for t in merged_at if start + OUTAGE_S < t], "merging resumes after the outage"
    # Learners that were training when the store went away kept training through the outage.
    checked = 0
    for rep in (store.get_json(k) for k in store.list("learners/") if k.endswith("report.json")):
        if rep["history"] and rep["history"][0][0] < start:
            steps_in = [h for h in rep["history"] if start + 1 < h[0] < start + OUTAGE_S - 1]
            assert len(steps_in) >= 2 and steps_in[-1][1] > steps_in[0][1], (
                f"learner {rep['learner_id']} stopped"
            )
            checked += 1
    assert checked >= 1, "no learner was running when the outage began"


def test_killing_the_syncer(disrupted):
    s, store, fired, _ = disrupted
    assert "SIGKILL" in fired and fired["SIGKILL"] > fired["SIGCONT"]
    assert store.get_json(keys.SYNCER_STATE)["incarnation"] == 1, "the syncer restarted once and resumed"
    assert [t for t in (r["merged_at"] for r in round_records(store)) if t > fired["SIGKILL"]], (
        "the restarted syncer merged again"
    )


@pytest.mark.long  # two 1M-token runs (53 s); joining ids and shards are checked in-process (test_join,
# test_shards)
def test_a_learner_added_mid_run_contributes_and_takes_work_off_the_first(tmp_path):
    # Steps of 32 sequences and H = 16: rounds far enough apart that the syncer is not the bottleneck (with
    # the harness's 4-sequence steps a round is due every ~12 ms and the syncer's round rate, not the
    # learners, sets the pace: a second learner then adds no merged tokens per second).
    one = ("diloco.learners=1", "diloco.token_budget=1000000", "diloco.sync_every=16", "train.batch_size=32")
    _, alone = run_with(tmp_path / "a", "alone", *one)
    # Added at ~35% of the run alone, whatever this machine's speed (both clocks start at prepare).
    at_s = round(0.35 * alone.wall_seconds, 1)
    run, s = run_with(
        tmp_path / "b", "added", *one, f"chaos.events=[{{kind: add_learner, learner: 1, at_s: {at_s}}}]"
    )
    store = open_store(run.url)
    contributed = sum(
        c["c_tokens"]
        for r in round_records(store)
        for k, c in r["contributors"].items()
        if k.startswith("1-")
    )
    assert contributed > 0
    assert s.ledger_balanced
    # The budget is shared: the first learner processes fewer tokens to reach it. (Not wall time: on a loaded
    # CI machine two learners on two cores need not finish sooner, 50.2 s vs 39.9 s in one such run; the
    # speed-up itself is a benchmark's business.)
    first_alone, first_added = alone.tokens_per_learner["0"], s.tokens_per_learner["0"]
    assert first_added < first_alone, (first_added, first_alone, s.wall_seconds, alone.wall_seconds)
