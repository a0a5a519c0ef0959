"""The report from hand-made run data (no training): chaos events, a dead incarnation, missing evaluations."""

from __future__ import annotations

import re

import pytest

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.posttrain.report import render_comparison_html, render_run_html, render_run_markdown
from ddiloco.posttrain.report_data import _event_time, flat_metrics, load_run
from ddiloco.store.memory import reset_memory_stores
from ddiloco.store.url import open_store

T0 = 1_800_000_000.0


def _record(r: int, t: float, contributors: dict[str, int]) -> dict:
    return {
        "round": r, "fragment_id": r % 2, "version": r // 2 + 1, "opened_at": t - 0.5, "merged_at": t,
        "time_to_quorum": 0.2, "grace_s": 0.1, "quorum": len(contributors), "rejected": {},
        "contributors": {c: {"c_tokens": n, "c_steps": 2, "c_seconds": 0.1, "base_version": 0, "staleness": r % 3,
                             "weight": 1.0} for c, n in contributors.items()},
    }  # fmt: skip


def _report(lid: int, inc: int, start: float, end: float, final: bool) -> dict:
    return {
        "learner_id": lid, "incarnation": inc, "started_at": start, "time": end, "final": final,
        "bytes_up": 1_000_000, "bytes_down": 2_000_000, "tokens_processed": 1000, "inner_step": 10,
        "history": [[start + 1, 1, 100, 5.0], [end, 10, 1000, 2.0]],
    }  # fmt: skip


@pytest.fixture()
def fake_run():
    reset_memory_stores()
    store = open_store("memory://reports/fake")
    cfg = RunConfig(run_id="fake")
    cfg.diloco.fragments = 2
    store.put_json(keys.CONFIG, cfg.to_dict())
    store.put_json(keys.LAYOUT, {"fragments": [{}, {}]})
    for r in range(12):
        store.put_json(
            keys.round_record_key(r), _record(r, T0 + 1 + r, {"0-0": 512, "1-0" if r < 5 else "1-1": 256})
        )
    store.put_json(keys.report_key(0, 0), _report(0, 0, T0, T0 + 14, True))
    store.put_json(keys.report_key(1, 0), _report(1, 0, T0 + 0.2, T0 + 5.5, False))
    store.put_json(keys.report_key(1, 1), _report(1, 1, T0 + 8, T0 + 14, True))
    store.put_json(
        keys.SUMMARY,
        {
            "run_id": "fake", "status": "done", "learners": 2, "quorum": 1, "num_fragments": 2, "goodput": 0.8,
            "incarnations": {"0": 1, "1": 2}, "rejected_updates": {"checksum": 1}, "final_val_loss": None,
            "chaos_events": [{"kind": "kill_learner", "learner": 1, "fired_at": T0 + 5.6, "time_s": 9.0}],
            "restarts": [{"role": "learner", "learner_id": 1, "time": 7.0, "restart": 1}],
        },
    )  # fmt: skip
    yield store
    reset_memory_stores()


def test_run_page_shows_chaos_and_dead_incarnations_without_evaluations(fake_run):
    run = load_run(fake_run, curve=False)
    assert [(e["kind"], round(e["t"], 1), e["learner_id"]) for e in run.view.events] == [
        ("kill_learner", 5.6, 1)
    ]
    page = render_run_html(run)
    assert "<td>kill_learner</td>" in page and "<td>5.6</td>" in page
    assert "not evaluated yet" in page and "<h2>Supervised fine-tuning</h2>" not in page
    assert len(re.findall(r"data:image/png;base64,", page)) == 7  # every plot but SFT
    md = render_run_markdown(run)
    assert md.startswith("# ddiloco run fake") and "| chaos events | 1 |" in md


def test_flat_metrics_are_scalars_with_flat_names(fake_run):
    s = load_run(fake_run, curve=False).summary
    s["task_accuracy"] = {"fact_mc": 0.5}
    m = flat_metrics(s)
    assert m["goodput"] == 0.8 and m["task_accuracy_fact_mc"] == 0.5
    assert m["chaos_events"] == 1.0 and m["incarnations"] == 3.0 and m["rejected_updates"] == 1.0
    assert "final_val_loss" not in m  # None is left out, not logged as 0


def test_goodput_and_merged_token_share_are_two_figures_each_explained(fake_run):
    """Issue 17 item 7: the paper's goodput and the merged-token share, side by side, one sentence each."""
    summary = fake_run.get_json(keys.SUMMARY)
    summary.update(goodput=0.97, merged_token_share=0.9, steps_per_answer=7.5, sync_every=8)
    fake_run.put_json(keys.SUMMARY, summary)
    run = load_run(fake_run, curve=False)
    page, md, m = render_run_html(run), render_run_markdown(run), flat_metrics(run.summary)
    assert "<td>goodput</td><td>97.0%</td>" in page and "<td>merged-token share</td><td>90.0%</td>" in page
    assert "| goodput | 97.0% |" in md and "| merged-token share | 90.0% |" in md
    assert "| inner steps per merged answer | 7.5 |" in md
    for text in (page, md):
        assert "Goodput: learner time spent training over provisioned learner time" in text
        assert "Merged-token share: tokens merged into the global model over tokens the learners" in text
    assert m["goodput"] == 0.97 and m["merged_token_share"] == 0.9 and m["steps_per_answer"] == 7.5


def test_efficiency_is_in_the_overview_and_the_kfp_metrics(fake_run):
    """Issue 52: processed tokens/s, MFU, data-loader wait and peak memory, as summary.json has them."""
    summary = fake_run.get_json(keys.SUMMARY)
    summary.update(processed_tokens_per_s=6100.0, mfu=0.412, data_wait_fraction=0.05)
    summary.update(peak_memory_bytes=2_500_000_000, peak_memory_kind="cuda_max_allocated")
    fake_run.put_json(keys.SUMMARY, summary)
    run = load_run(fake_run, curve=False)
    md, m = render_run_markdown(run), flat_metrics(run.summary)
    assert "| processed tokens/s / MFU / data-loader wait | 6,100 / 41.2% / 5.0% |" in md
    assert "| peak learner memory | 2,500.00 MB (cuda_max_allocated) |" in md
    assert m["mfu"] == 0.412 and m["peak_memory_bytes"] == 2.5e9


def test_comparison_of_the_same_run_twice_renders(fake_run):
    run = load_run(fake_run, curve=False)
    page = render_comparison_html([run, run])
    assert page.count("fake (M=2, K=1)") >= 2 and "<h2>Runs</h2>" in page


def test_event_times_accept_epoch_and_relative_seconds():
    assert _event_time({"fired_at": T0 + 3}, T0) == 3.0
    assert _event_time({"wall_time": T0 + 2, "time_s": 99}, T0) == 2.0
    assert _event_time({"time_s": 4.5}, T0) == 4.5
    assert _event_time({"kind": "x"}, T0) is None


def test_a_prefix_without_a_run_is_a_clear_error():
    reset_memory_stores()
    with pytest.raises(ValueError, match="holds no ddiloco run"):
        load_run(open_store("memory://reports/empty"), curve=False)
