"""Reports people review after a run: `report.html` (self-contained, plots embedded), `summary.md`, and a flat
metrics dict — for one run, or a comparison of several (`ddiloco report RUN [RUN ...]`).

Design choices:
- Everything comes from the store alone (summary.json, round records, learner reports, eval/ and sft/
  JSON), so a report can be made for any run, finished or not, from anywhere that can read its prefix.
- The global model's validation loss over the run is computed post hoc (`evaluate.global_loss_curve`: the
  model as of several merges, assembled from published global versions) and cached in eval/curve.json.
- The HTML is one file: inline CSS, PNGs as base64 data URIs, no scripts, no external requests — the KFP UI
  renders it in a sandboxed iframe. The same HTML / Markdown / flat metrics feed the KFP `HTML`,
  `Markdown` and `Metrics` artifacts.
- Missing pieces (no evaluation yet, no chaos) show as "—" or a note; a report never fails for lack of data.
- Processes that died (a killed learner incarnation, a SIGTERMed syncer, ...) show the last lines of the log
  they shipped to the store (`ddiloco.logship`): a deleted pod's log is gone from Kubernetes, not from here.
"""

from __future__ import annotations

import base64
import html
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco import keys, logship
from ddiloco.posttrain import plots
from ddiloco.posttrain.evaluate import SFT_META, eval_key, global_loss_curve
from ddiloco.posttrain.summary import build_summary, read_reports, read_round_records
from ddiloco.store import Store, StoreError

log = logging.getLogger(__name__)

REPORT_HTML = "report/report.html"
REPORT_MD = "report/summary.md"
REPORT_METRICS = "report/metrics.json"

CSS = """
body{font-family:-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;margin:24px auto;max-width:1180px;
color:#222;padding:0 16px}h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.25em;border-bottom:1px solid #ddd;
padding-bottom:.2em;margin-top:1.6em}.sub{color:#666;margin-top:0}table{border-collapse:collapse;margin:.6em 0;
font-size:.9em}th,td{border:1px solid #ddd;padding:4px 10px;text-align:right}th:first-child,td:first-child{text-align:left}
th{background:#f4f4f4}.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:0 28px}
.wide{grid-column:1/-1}.plots{display:flex;flex-wrap:wrap;gap:12px}img{max-width:100%;border:1px solid #eee}
.note{color:#666;font-size:.9em}.better{color:#1a7f37;font-weight:600}
pre{background:#f6f6f6;border:1px solid #eee;padding:6px;font-size:.78em;overflow-x:auto;white-space:pre}
"""


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
    summary = store.get_json_or_none(keys.SUMMARY, max_bytes=16 << 20) or build_summary(store)
    config = store.get_json(keys.CONFIG)
    records = read_round_records(store)
    reports = read_reports(store)
    starts = [r["started_at"] for r in reports] + [r["opened_at"] for r in records]
    t0 = min(starts) if starts else time.time()
    points = (
        global_loss_curve(store, curve_points, records=records) if curve and store.exists(keys.LAYOUT) else []
    )
    evals = {}
    for key in store.list("eval/"):
        name = key[len("eval/") : -len(".json")]
        if key.endswith(".json") and key != eval_key("curve"):
            evals[name] = store.get_json(key, max_bytes=16 << 20)
    sft = store.get_json_or_none(SFT_META, max_bytes=16 << 20)
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
        "sft_val_loss sft_perplexity entropy_floor"
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
    return out


def _fmt(v: Any, digits: int = 4) -> str:
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
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in sorted(v.items())) or "—"
    return str(v)


def _mb(v: Any) -> str:
    return "—" if v is None else f"{v / 1e6:,.2f} MB"


def _seconds(v: Any) -> str:
    return "—" if v is None else f"{_fmt(v, 3)} s"


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


def overview_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        ("status", _fmt(s.get("status"))),
        ("wall time", _seconds(s.get("wall_seconds"))),
        ("learners M / quorum K / fragments P", " / ".join(_fmt(s.get(k)) for k in ("learners", "quorum", "num_fragments"))),
        ("sync every H / overlap τ / codec", " / ".join(_fmt(s.get(k)) for k in ("sync_every", "overlap", "codec"))),
        ("inner steps per merged answer", _fmt(s.get("steps_per_answer"), 3)),
        ("model parameters", _fmt(s.get("model_params"))),
        ("tokens processed / merged / discarded", " / ".join(_fmt(s.get(k)) for k in ("tokens_processed", "tokens_merged", "tokens_discarded"))),
        ("ledger balanced", _fmt(s.get("ledger_balanced"))),
        ("rounds merged / abandoned", f"{_fmt(s.get('rounds'))} / {_fmt(s.get('rounds_abandoned'))}"),
        ("goodput", _pct(s.get("goodput"))),
        ("merged-token share", _pct(s.get("merged_token_share"))),
        ("mean quorum / grace / time to quorum", f"{_fmt(s.get('mean_quorum'), 3)} / {_seconds(s.get('mean_grace_seconds'))} / {_seconds(s.get('mean_time_to_quorum_seconds'))}"),
        ("mean staleness", _fmt(s.get("mean_staleness"), 3)),
        ("bytes up / down / published", " / ".join(_mb(s.get(k)) for k in ("bytes_uploaded", "bytes_downloaded", "bytes_published"))),
        ("rejected updates", _fmt(s.get("rejected_updates") or None)),
        ("incarnations per learner", _fmt(s.get("incarnations"))),
        ("chaos events", str(len(s.get("chaos_events") or []))),
        ("validation loss: initial → final → SFT", " → ".join(_fmt(s.get(k)) for k in ("initial_val_loss", "final_val_loss", "sft_val_loss"))),
        ("entropy floor of the corpus", _fmt(s.get("entropy_floor"))),
    ]  # fmt: skip


def task_rows(s: dict[str, Any], evals: dict[str, dict[str, Any]]) -> list[list[str]]:
    """[name, metric, items, pretrained, after SFT]: validation loss and perplexity, then every task."""
    pre, post = s.get("task_accuracy") or {}, s.get("sft_task_accuracy") or {}
    info = (evals.get("final") or evals.get("sft") or {}).get("tasks", {})
    rows = [
        [
            t,
            str(info.get(t, {}).get("metric", "")),
            _fmt(info.get(t, {}).get("n")),
            _pct(pre.get(t)),
            _pct(post.get(t)),
        ]
        for t in sorted(set(pre) | set(post))
    ]
    if not rows:
        return []
    losses = [_fmt(s.get(k)) for k in ("final_val_loss", "sft_val_loss")]
    ppl = [_fmt((evals.get(name) or {}).get("perplexity")) for name in ("final", "sft")]
    return [["validation loss", "nats/token", "", *losses], ["perplexity", "", "", *ppl], *rows]


def site_rows(s: dict[str, Any]) -> list[list[str]]:
    """[site, learner ids, tokens processed, tokens merged, share of merged] per site (learners joined from
    elsewhere report their --site; everything else is `local`)."""
    merged, processed = s.get("tokens_merged_by_site") or {}, s.get("tokens_processed_by_site") or {}
    total = sum(merged.values())
    ids = s.get("learners_by_site") or {}
    return [
        [site, ", ".join(str(i) for i in ids.get(site, [])), _fmt(processed.get(site)), _fmt(merged.get(site)),
         _pct(merged.get(site, 0) / total if total else None)]
        for site in sorted(set(merged) | set(processed))
    ]  # fmt: skip


SITE_HEADER = ["site", "learners", "tokens processed", "tokens merged", "share of merged"]


def instruction_rows(s: dict[str, Any]) -> list[list[str]]:
    before, after = s.get("instruction_accuracy_before") or {}, s.get("instruction_accuracy_after") or {}
    return [
        [k, _pct(before.get(k)), _pct(after.get(k))]
        for k in sorted(set(before) | set(after), key=lambda k: (k == "all", k))
    ]


# --- HTML / Markdown -----------------------------------------------------------------------------------------
def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if any(header) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


DEATHS = "Processes that died: their last log lines"
DEATH_LINES = 20
WIDE = frozenset({"Loss", "Runs", DEATHS})


def _death_title(d: dict[str, Any]) -> str:
    dropped = f", {d['dropped_lines']} older dropped" if d.get("dropped_lines") else ""
    return f"{d['who']}: {d['why']} (last {len(d['lines'])} of {d['total_lines']} lines{dropped}; {d['key']})"


def deaths_html(deaths: list[dict[str, Any]]) -> str:
    return (
        "".join(
            f"<p>{html.escape(_death_title(d))}</p><pre>{html.escape(chr(10).join(d['lines']))}</pre>"
            for d in deaths
        )
        + '<p class="note">All of them: <code>ddiloco logs --store RUN_ROOT --role ROLE [--id N]</code>.</p>'
    )


def deaths_markdown(deaths: list[dict[str, Any]]) -> list[str]:
    lines = ["", f"## {DEATHS}"]
    for d in deaths:
        fence = "~~~~" if any("```" in x for x in d["lines"]) else "```"
        lines += ["", f"**{_death_title(d)}**", "", fence, *d["lines"], fence]
    return lines


def _page(title: str, subtitle: str, sections: list[tuple[str, str]]) -> str:
    """A page of sections in a two-column grid; the sections named in WIDE span both columns."""
    parts = []
    for h, body in sections:
        attr = ' class="wide"' if h in WIDE else ""
        parts.append(f"<section{attr}><h2>{html.escape(h)}</h2>\n{body}</section>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
        f'<h1>{html.escape(title)}</h1><p class="sub">{html.escape(subtitle)}</p>\n<div class="grid">\n'
        + "\n".join(parts)
        + "\n</div></body></html>\n"
    )


def render_run_html(run: RunData) -> str:
    s, v = run.summary, run.view
    chaos_rows = [[f"{e['t']:.1f}", e["kind"], _fmt(e.get("learner_id"))] for e in v.events]
    tasks = task_rows(s, run.evals)
    eval_html = (
        _table(["task", "metric", "items", "pretrained", "after SFT"], tasks)
        if tasks
        else '<p class="note">not evaluated yet: run <code>ddiloco evaluate</code>.</p>'
    )
    sections = [
        (
            "Summary",
            _table(["", ""], [list(r) for r in overview_rows(s)])
            + "".join(f'<p class="note">{html.escape(n)}</p>' for n in GOODPUT_NOTES),
        ),
        ("Evaluation", eval_html),
        (
            "Loss",
            '<div class="plots">'
            + _img(plots.loss_vs_tokens([v]), "loss vs tokens")
            + _img(plots.loss_vs_time([v]), "loss vs time")
            + "</div>"
            '<p class="note">Global model: validation loss of the model assembled from the global versions published by '
            "each point (post hoc, eval/curve.json). Learners: training-loss EMA from their reports.</p>",
        ),
        (
            "Merged tokens and chaos events",
            _img(plots.merged_tokens([v]), "merged tokens over time")
            + (
                _table(["seconds", "event", "learner"], chaos_rows)
                if chaos_rows
                else '<p class="note">no chaos events.</p>'
            ),
        ),
        ("Learner incarnations", _img(plots.incarnations(v), "learner incarnations")),
        (
            "Sites",
            _table(SITE_HEADER, site_rows(s)) if site_rows(s) else '<p class="note">no learner reports.</p>',
        ),
        ("Rounds: quorum and grace", _img(plots.rounds([v]), "quorum and grace per round")),
        ("Staleness", _img(plots.staleness([v]), "staleness histogram")),
        ("Traffic", _img(plots.traffic([v]), "bytes per learner")),
    ]
    if run.deaths:
        sections.append((DEATHS, deaths_html(run.deaths)))
    if run.sft is not None:
        sft = run.sft
        sections.append(
            (
                "Supervised fine-tuning",
                f"<p>{_fmt(sft.get('steps'))} steps on {_fmt(sft.get('train_items'))} {html.escape(str(sft.get('data')))} "
                f"instruction items in {_fmt(sft.get('train_seconds'), 3)} s ({html.escape(str(sft.get('device')))}); "
                f"held out {html.escape(str(sft.get('heldout_split')))}. Exact match on the held-out instructions:</p>"
                + _table(["instructions", "pretrained", "after SFT"], instruction_rows(s))
                + f'<p class="note">Held-out response loss (teacher-forced, nats/token): '
                f"{_fmt(sft.get('heldout_response_loss_before'))} → {_fmt(sft.get('heldout_response_loss_after'))}.</p>"
                + _img(plots.sft_loss(sft.get("loss_curve") or [], int(sft.get("steps") or 0)), "SFT loss"),
            )
        )
    return _page(f"ddiloco run report — {run.run_id}", f"{run.url} · {v.label}", sections)


def render_run_markdown(run: RunData) -> str:
    s = run.summary
    lines = [f"# ddiloco run {run.run_id}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in overview_rows(s)]
    lines += ["", *GOODPUT_NOTES]
    rows = task_rows(s, run.evals)
    if rows:
        lines += [
            "",
            "## Evaluation",
            "",
            "| task | metric | items | pretrained | after SFT |",
            "|---|---|---:|---:|---:|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    if site_rows(s):
        lines += ["", "## Sites", "", "| " + " | ".join(SITE_HEADER) + " |", "|---|---|---:|---:|---:|"]
        lines += ["| " + " | ".join(r) + " |" for r in site_rows(s)]
    if instruction_rows(s):
        lines += [
            "",
            "## Held-out instructions (exact match)",
            "",
            "| kind | pretrained | after SFT |",
            "|---|---:|---:|",
        ]
        lines += ["| " + " | ".join(r) + " |" for r in instruction_rows(s)]
    if run.deaths:
        lines += deaths_markdown(run.deaths)
    return "\n".join(lines) + "\n"


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


def render_comparison_html(runs: list[RunData]) -> str:
    views = [r.view for r in runs]
    header, rows = comparison_rows(runs)
    sections = [
        ("Runs", _table(header, rows)),
        ("Loss", '<div class="plots">' + _img(plots.loss_vs_tokens(views, learners=False), "loss vs tokens") + _img(plots.loss_vs_time(views), "loss vs time") + "</div>"),
        ("Merged tokens", _img(plots.merged_tokens(views), "merged tokens over time")),
        ("Rounds: quorum and grace", _img(plots.rounds(views), "quorum and grace per round")),
        ("Staleness", _img(plots.staleness(views), "staleness histogram")),
        ("Traffic", _img(plots.traffic(views), "bytes per learner")),
    ]  # fmt: skip
    return _page(f"ddiloco comparison — {len(runs)} runs", " · ".join(r.url for r in runs), sections)


def render_comparison_markdown(runs: list[RunData]) -> str:
    header, rows = comparison_rows(runs)
    lines = [f"# ddiloco comparison of {len(runs)} runs", "", "| " + " | ".join(header) + " |"]
    lines += ["|---|" + "---:|" * len(runs)] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# --- writing -------------------------------------------------------------------------------------------------
def _write_local(out_dir: str | Path, html_text: str, md: str, metrics: dict[str, Any]) -> dict[str, str]:
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"html": out / "report.html", "markdown": out / "summary.md", "metrics": out / "metrics.json"}
    paths["html"].write_text(html_text, encoding="utf-8")
    paths["markdown"].write_text(md, encoding="utf-8")
    paths["metrics"].write_text(json.dumps(metrics, indent=2, sort_keys=True), encoding="utf-8")
    return {k: str(p) for k, p in paths.items()}


def write_reports(
    store: Store, out_dir: str | Path | None = None, *, curve_points: int = 8
) -> dict[str, Any]:
    """report.html, summary.md and metrics.json of one run: to the store under report/ and, with out_dir,
    to that directory. Returns {"html", "markdown", "metrics", "keys", "paths"}."""
    run = load_run(store, curve_points=curve_points)
    html_text, md, metrics = render_run_html(run), render_run_markdown(run), flat_metrics(run.summary)
    store.put(REPORT_HTML, html_text.encode())
    store.put(REPORT_MD, md.encode())
    store.put_json(REPORT_METRICS, metrics)
    paths = _write_local(out_dir, html_text, md, metrics) if out_dir is not None else {}
    log.info("report for run %s written to %s/%s", run.run_id, store.url, REPORT_HTML)
    return {
        "html": html_text,
        "markdown": md,
        "metrics": metrics,
        "keys": [REPORT_HTML, REPORT_MD, REPORT_METRICS],
        "paths": paths,
    }


def write_comparison(stores: list[Store], out_dir: str | Path, *, curve_points: int = 8) -> dict[str, Any]:
    """A comparison page of several runs, written to out_dir (report.html, summary.md, metrics.json)."""
    if len(stores) < 2:
        raise ValueError("a comparison needs at least two runs")
    runs = [load_run(s, curve_points=curve_points) for s in stores]
    html_text, md = render_comparison_html(runs), render_comparison_markdown(runs)
    metrics = {r.view.label: flat_metrics(r.summary) for r in runs}
    paths = _write_local(out_dir, html_text, md, metrics)
    log.info("comparison of %d runs written to %s", len(runs), paths["html"])
    return {"html": html_text, "markdown": md, "metrics": metrics, "paths": paths}
