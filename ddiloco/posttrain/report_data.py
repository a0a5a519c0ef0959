"""What a run report shows, as data: the run read from its store (`load_run`), the flat metrics, and the
tables' rows as text (`overview_rows`, `task_rows`, ...), which `ddiloco.posttrain.report` lays out as HTML
and Markdown.

Design choices:
- Everything comes from the store alone (summary.json, round records, learner reports, eval/ and sft/
  JSON), so a report can be made for any run, finished or not, from anywhere that can read its prefix.
- The global model's validation loss over the run is computed post hoc (`evaluate.global_loss_curve`: the
  model as of several merges, assembled from the global versions the store still keeps: retention keeps
  evenly spaced moments of the run, `ddiloco.config.retention`) and cached in eval/curve.json.
- summary.json may predate the evaluation (`ddiloco evaluate` ran later): `load_run` fills what it lacks
  from eval/ and sft/.
- Missing pieces (no evaluation yet, no chaos) show as "—"; a report never fails for lack of data.
- Rows are formatted once here, so the HTML and the Markdown show the same figures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ddiloco import keys
from ddiloco.posttrain import plots
from ddiloco.posttrain.evaluate import global_loss_curve
from ddiloco.posttrain.summary import build_summary, read_reports, read_round_records
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store, StoreError
from ddiloco.tracking import logship
from ddiloco.tracking.info import tracking_info

log = logging.getLogger(__name__)

DEATH_LINES = 20
"""Log lines shown per process that died."""


@dataclass(slots=True)
class RunData:
    url: str
    summary: dict[str, Any]
    config: dict[str, Any]
    view: plots.RunView
    evals: dict[str, dict[str, Any]]
    sft: dict[str, Any] | None
    deaths: list[dict[str, Any]] = field(default_factory=list)
    """`logship.died`: the last log lines of each process incarnation that died."""

    @property
    def run_id(self) -> str:
        return str(self.summary.get("run_id"))


def run_label(summary: dict[str, Any]) -> str:
    return f"{summary.get('run_id')} (M={summary.get('learners')}, K={summary.get('quorum')})"


def _event_time(ev: dict[str, Any], t0: float) -> float | None:
    """Seconds since t0 of a chaos event or restart: an epoch time (`fired_at`, `wall_time`) when there is one;
    else `time_s` / `time`, read as epoch seconds when large and as seconds since t0 otherwise."""
    for k in ("fired_at", "wall_time", "time_s", "time"):
        if ev.get(k) is not None:
            v = float(ev[k])
            return v - t0 if v > 1e9 else v
    return None


def _learner(ev: dict[str, Any]) -> Any:
    return ev.get("learner_id", ev.get("learner"))


def _events(summary: dict[str, Any], t0: float) -> list[dict[str, Any]]:
    out = []
    for ev in summary.get("chaos_events") or []:
        t = _event_time(ev, t0)
        if t is not None:
            out.append({"kind": ev.get("kind", "chaos"), "t": t, "learner_id": _learner(ev)})
    for ev in summary.get("restarts") or []:
        # The local launcher's restart times count from its own start; only epoch times can be placed.
        t = _event_time(ev, t0) if (ev.get("wall_time") or ev.get("fired_at")) else None
        if t is not None and ev.get("role") == "learner":
            out.append({"kind": "restart", "t": t, "learner_id": _learner(ev)})
    return sorted(out, key=lambda e: e["t"])


def load_run(store: Store, *, curve_points: int = 8, curve: bool = True) -> RunData:
    """Everything a report shows about the run at `store`; computes (and caches) the global loss curve."""
    if not store.exists(keys.CONFIG):
        raise ValueError(
            f"{store.url} holds no ddiloco run (no {keys.CONFIG}); pass a run root, e.g. runs/RUN_ID"
        )
    summary = store.get_json_or_none(keys.SUMMARY, max_bytes=16 << 20) or build_summary(store).to_json()
    config = store.get_json(keys.CONFIG)
    records = read_round_records(store)
    reports = read_reports(store)
    starts = [r["started_at"] for r in reports] + [r["opened_at"] for r in records]
    t0 = min(starts) if starts else time.time()
    points = (
        global_loss_curve(RunRoot.from_env(store, role="report"), curve_points, records=records)
        if curve and store.exists(keys.LAYOUT)
        else []
    )
    evals = {}
    for key in store.list(keys.EVAL):
        name = keys.eval_name(key)
        if name is not None:
            evals[name] = store.get_json(key, max_bytes=16 << 20)
    sft = store.get_json_or_none(keys.SFT_META, max_bytes=16 << 20)
    # summary.json may predate the evaluation (e.g. `ddiloco evaluate` ran later): fill what it lacks.
    filled = {
        "final_val_loss": (evals.get("final") or {}).get("val_loss"),
        "task_accuracy": (evals.get("final") or {}).get("task_accuracy"),
        "sft_val_loss": (evals.get("sft") or {}).get("val_loss"),
        "sft_task_accuracy": (evals.get("sft") or {}).get("task_accuracy"),
        "instruction_accuracy_before": (sft or {}).get("instruction_accuracy_before"),
        "instruction_accuracy_after": (sft or {}).get("instruction_accuracy_after"),
    }
    for key, value in filled.items():
        if summary.get(key) is None:
            summary[key] = value
    summary["tracking"] = tracking_info(store)  # read now: post-training may have logged since the summary
    view = plots.RunView(
        label=run_label(summary),
        t0=t0,
        records=records,
        reports=reports,
        curve=points,
        num_fragments=int(summary.get("num_fragments") or config["diloco"]["fragments"]),
        events=_events(summary, t0),
    )
    try:
        deaths = logship.died(store, reports, done=store.exists(keys.DONE), tail=DEATH_LINES)
    except StoreError as e:
        log.warning("report: shipped logs unreadable (%s)", e)
        deaths = []
    return RunData(
        url=store.url, summary=summary, config=config, view=view, evals=evals, sft=sft, deaths=deaths
    )


# --- numbers -------------------------------------------------------------------------------------------------
def flat_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics with flat names (KFP `Metrics.log_metric`); nested dicts become `outer_inner`."""
    out: dict[str, float] = {}
    names = (
        "wall_seconds tokens_processed tokens_merged tokens_discarded rounds goodput merged_token_share "
        "steps_per_answer bytes_uploaded bytes_downloaded mean_quorum mean_grace_seconds mean_staleness "
        "initial_val_loss final_val_loss final_perplexity "
        "sft_val_loss sft_perplexity entropy_floor "
        "processed_tokens_per_s mfu data_wait_fraction peak_memory_bytes"
    ).split()
    for k in names:
        v = summary.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool):
            out[k] = float(v)
    for k in (
        "task_accuracy",
        "sft_task_accuracy",
        "instruction_accuracy_before",
        "instruction_accuracy_after",
        "tokens_merged_by_site",
    ):
        for name, v in sorted((summary.get(k) or {}).items()):
            out[f"{k}_{name}"] = float(v)
    out["chaos_events"] = float(len(summary.get("chaos_events") or []))
    out["incarnations"] = float(sum((summary.get("incarnations") or {}).values()))
    out["rejected_updates"] = float(sum((summary.get("rejected_updates") or {}).values()))
    out["shared_shards"] = float(len(summary.get("shared_shards") or {}))
    return out


def fmt(v: Any, digits: int = 4) -> str:
    """A figure as the tables show it: "—" for missing, thousands separators, 4 significant digits."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if v.is_integer() and abs(v) >= 1000:
            return f"{int(v):,}"
        return f"{v:.{digits}g}" if abs(v) < 1e5 else f"{v:,.0f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {fmt(x)}" for k, x in sorted(v.items())) or "—"
    return str(v)


def _mb(v: Any) -> str:
    return "—" if v is None else f"{v / 1e6:,.2f} MB"


def _seconds(v: Any) -> str:
    return "—" if v is None else f"{fmt(v, 3)} s"


def _pct(v: Any) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


GOODPUT_NOTES = (
    "Goodput: learner time spent training over provisioned learner time (the paper's measure); time lost "
    "to kills, restarts, rejoins and stalls is what it leaves out, so a run without failures comes close "
    "to 100%.",
    "Merged-token share: tokens merged into the global model over tokens the learners processed; overlap "
    "steps that a newer global version overwrites (α = 0) and late answers count against it, not against "
    "goodput.",
)


def _shared_shards(s: dict[str, Any]) -> str:
    """The data row: "4 / none", or "4 / shard 1: learners 1, 9" when learners read one shard (`ddiloco.data.shards`)."""
    shared = s.get("shared_shards") or {}
    what = "; ".join(f"shard {k}: learners {', '.join(map(str, ids))}" for k, ids in shared.items())
    return f"{fmt(s.get('data_shards'))} / {what or 'none'}"


def overview_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("status", fmt(s.get("status"))),
        ("wall time", _seconds(s.get("wall_seconds"))),
        (
            "learners M / quorum K / fragments P",
            " / ".join(fmt(s.get(k)) for k in ("learners", "quorum", "num_fragments")),
        ),
        (
            "sync every H / overlap τ / codec",
            " / ".join(fmt(s.get(k)) for k in ("sync_every", "overlap", "codec")),
        ),
        ("inner steps per merged answer", fmt(s.get("steps_per_answer"), 3)),
        ("model parameters", fmt(s.get("model_params"))),
        (
            "tokens processed / merged / discarded",
            " / ".join(fmt(s.get(k)) for k in ("tokens_processed", "tokens_merged", "tokens_discarded")),
        ),
        ("ledger balanced", fmt(s.get("ledger_balanced"))),
        ("rounds merged / abandoned", f"{fmt(s.get('rounds'))} / {fmt(s.get('rounds_abandoned'))}"),
        ("goodput", _pct(s.get("goodput"))),
        ("merged-token share", _pct(s.get("merged_token_share"))),
        (
            "processed tokens/s / MFU / data-loader wait",
            f"{fmt(s.get('processed_tokens_per_s'), 4)} / {_pct(s.get('mfu'))} / {_pct(s.get('data_wait_fraction'))}",
        ),
        ("peak learner memory", f"{_mb(s.get('peak_memory_bytes'))} ({fmt(s.get('peak_memory_kind'))})"),
        (
            "mean quorum / grace / time to quorum",
            f"{fmt(s.get('mean_quorum'), 3)} / {_seconds(s.get('mean_grace_seconds'))} / {_seconds(s.get('mean_time_to_quorum_seconds'))}",
        ),
        ("mean staleness", fmt(s.get("mean_staleness"), 3)),
        (
            "bytes up / down / published",
            " / ".join(_mb(s.get(k)) for k in ("bytes_uploaded", "bytes_downloaded", "bytes_published")),
        ),
        (
            "store size / global versions kept per fragment",
            f"{_mb(s.get('store_bytes'))} / {fmt(s.get('global_versions_kept'))}",
        ),
        ("rejected updates", fmt(s.get("rejected_updates") or None)),
        ("incarnations per learner", fmt(s.get("incarnations"))),
        ("data shards / shared by learners", _shared_shards(s)),
        ("chaos events", str(len(s.get("chaos_events") or []))),
        (
            "validation loss: initial → final → SFT",
            " → ".join(fmt(s.get(k)) for k in ("initial_val_loss", "final_val_loss", "sft_val_loss")),
        ),
        ("entropy floor of the corpus", fmt(s.get("entropy_floor"))),
    ]


def task_rows(s: dict[str, Any], evals: dict[str, dict[str, Any]]) -> list[list[str]]:
    """[name, metric, items, pretrained, after SFT]: validation loss and perplexity, then every task."""
    pre, post = s.get("task_accuracy") or {}, s.get("sft_task_accuracy") or {}
    info = (evals.get("final") or evals.get("sft") or {}).get("tasks", {})
    rows = [
        [
            t,
            str(info.get(t, {}).get("metric", "")),
            fmt(info.get(t, {}).get("n")),
            _pct(pre.get(t)),
            _pct(post.get(t)),
        ]
        for t in sorted(set(pre) | set(post))
    ]
    if not rows:
        return []
    losses = [fmt(s.get(k)) for k in ("final_val_loss", "sft_val_loss")]
    ppl = [fmt((evals.get(name) or {}).get("perplexity")) for name in ("final", "sft")]
    return [["validation loss", "nats/token", "", *losses], ["perplexity", "", "", *ppl], *rows]


LM_EVAL_HEADER = ["checkpoint", "task", "metric", "value", "stderr", "items"]


def lm_eval_rows(evals: dict[str, dict[str, Any]]) -> list[list[str]]:
    """One row per (checkpoint, task, metric) of the lm-evaluation-harness results (eval/lm-NAME.json)."""
    rows = []
    for name in sorted(n for n in evals if n.startswith("lm-")):
        e = evals[name]
        n_samples = e.get("n-samples") or {}
        for task, values in sorted((e.get("results") or {}).items()):
            for key, value in sorted(values.items()):
                if "," not in key or "_stderr," in key or not isinstance(value, int | float):
                    continue
                metric, flt = key.split(",", 1)
                stderr = values.get(f"{metric}_stderr,{flt}")
                items = (n_samples.get(task) or {}).get("effective")
                rows.append([e.get("model") or name[3:], task, metric, fmt(value), fmt(stderr), fmt(items)])
    return rows


def site_rows(s: dict[str, Any]) -> list[list[str]]:
    """[site, learner ids, tokens processed, tokens merged, share of merged] per site (learners joined from
    elsewhere report their --site; everything else is `local`)."""
    merged, processed = s.get("tokens_merged_by_site") or {}, s.get("tokens_processed_by_site") or {}
    total = sum(merged.values())
    ids = s.get("learners_by_site") or {}
    return [
        [
            site,
            ", ".join(str(i) for i in ids.get(site, [])),
            fmt(processed.get(site)),
            fmt(merged.get(site)),
            _pct(merged.get(site, 0) / total if total else None),
        ]
        for site in sorted(set(merged) | set(processed))
    ]


SITE_HEADER = ["site", "learners", "tokens processed", "tokens merged", "share of merged"]


def instruction_rows(s: dict[str, Any]) -> list[list[str]]:
    before, after = s.get("instruction_accuracy_before") or {}, s.get("instruction_accuracy_after") or {}
    return [
        [k, _pct(before.get(k)), _pct(after.get(k))]
        for k in sorted(set(before) | set(after), key=lambda k: (k == "all", k))
    ]


def comparison_rows(runs: list[RunData]) -> tuple[list[str], list[list[str]]]:
    """(header, rows): one column per run, the overview rows then accuracies as "pretrained / SFT"."""
    ss = [r.summary for r in runs]
    names = [name for name, _ in overview_rows(ss[0])]
    columns = [[value for _, value in overview_rows(s)] for s in ss]
    rows = [[name, *(col[i] for col in columns)] for i, name in enumerate(names)]

    def pair(s: dict[str, Any], before: str, after: str, key: str) -> str:
        return f"{_pct((s.get(before) or {}).get(key))} / {_pct((s.get(after) or {}).get(key))}"

    for t in sorted({t for s in ss for t in (s.get("task_accuracy") or {})}):
        rows.append(
            [f"{t} (pretrained / SFT)", *(pair(s, "task_accuracy", "sft_task_accuracy", t) for s in ss)]
        )
    if any(s.get("instruction_accuracy_after") for s in ss):
        rows.append(
            [
                "held-out instructions (pretrained / SFT)",
                *(pair(s, "instruction_accuracy_before", "instruction_accuracy_after", "all") for s in ss),
            ]
        )
    return ["", *(r.view.label for r in runs)], rows
