"""Reports people review after a run: `report.html` (self-contained, plots embedded), `summary.md`, and a flat
metrics dict — for one run, or a comparison of several (`ddiloco report RUN [RUN ...]`).

Design choices:
- The figures come from `ddiloco.posttrain.report_data` (the run read from its store, the rows as text);
  this module lays them out and writes them.
- The HTML is one file: inline CSS, PNGs as base64 data URIs, no scripts, no external requests — the KFP UI
  renders it in a sandboxed iframe. The same HTML / Markdown / flat metrics feed the KFP `HTML`,
  `Markdown` and `Metrics` artifacts.
- Missing pieces (no evaluation yet, no chaos) show as "—" or a note; a report never fails for lack of data.
- Processes that died (a killed learner incarnation, a SIGTERMed syncer, ...) show the last lines of the log
  they shipped to the store (`ddiloco.tracking.logship`): a deleted pod's log is gone from Kubernetes, not from here.
"""

from __future__ import annotations

import base64
import html
import json
import logging
from pathlib import Path
from typing import Any

from ddiloco import keys
from ddiloco.posttrain import plots
from ddiloco.posttrain.report_data import (
    GOODPUT_NOTES,
    LM_EVAL_HEADER,
    SITE_HEADER,
    RunData,
    comparison_rows,
    flat_metrics,
    fmt,
    instruction_rows,
    lm_eval_rows,
    load_run,
    overview_rows,
    site_rows,
    task_rows,
)
from ddiloco.store.base import Store

log = logging.getLogger(__name__)

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


# --- HTML / Markdown -----------------------------------------------------------------------------------------
def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    thead = f"<thead><tr>{head}</tr></thead>" if any(header) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


DEATHS = "Processes that died: their last log lines"
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


def tracking_lines(t: dict[str, Any] | None) -> list[tuple[str, str, str | None]]:
    """(what, where, link or None) of the run's experiment tracking (`ddiloco.tracking.info`)."""
    t = t or {}
    out: list[tuple[str, str, str | None]] = []
    if t.get("tensorboard"):
        runs = ", ".join(t.get("tensorboard_runs") or [])
        out.append(
            (
                "TensorBoard log directory (`tensorboard --logdir`, a Kubeflow Tensorboard)",
                t["tensorboard"],
                None,
            )
        )
        out.append(("TensorBoard runs", runs, None))
    if t.get("mlflow_link"):
        link = t["mlflow_link"]
        out.append(("MLflow run", link, link if link.startswith(("http://", "https://")) else None))
    if dropped := sum((t.get("dropped_events") or {}).values()):
        out.append(("tracking events dropped (backend down or slow)", str(dropped), None))
    return out


def tracking_html(t: dict[str, Any] | None) -> str:
    lines = tracking_lines(t)
    if not lines:
        return '<p class="note">nothing tracked: see tracking.tensorboard and tracking.mlflow_uri.</p>'
    cells = [
        f'<a href="{html.escape(link)}" target="_blank" rel="noopener">{html.escape(where)}</a>'
        if link
        else f"<code>{html.escape(where)}</code>"
        for _, where, link in lines
    ]
    body = "".join(
        f"<tr><td>{html.escape(w)}</td><td>{c}</td></tr>" for (w, _, _), c in zip(lines, cells, strict=True)
    )
    return f"<table><tbody>{body}</tbody></table>"


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
    chaos_rows = [[f"{e['t']:.1f}", e["kind"], fmt(e.get("learner_id"))] for e in v.events]
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
        *(
            [("lm-evaluation-harness", _table(LM_EVAL_HEADER, lm_rows))]
            if (lm_rows := lm_eval_rows(run.evals))
            else []
        ),
        (
            "Loss",
            '<div class="plots">'
            + _img(plots.loss_vs_tokens([v]), "loss vs tokens")
            + _img(plots.loss_vs_time([v]), "loss vs time")
            + "</div>"
            '<p class="note">Global model: validation loss of the model assembled from the global versions published by '
            "each point, at the moments whose versions the store keeps (post hoc, eval/curve.json). "
            "Learners: training-loss EMA from their reports.</p>",
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
        ("Experiment tracking", tracking_html(s.get("tracking"))),
    ]
    if run.deaths:
        sections.append((DEATHS, deaths_html(run.deaths)))
    if run.sft is not None:
        sft = run.sft
        sections.append(
            (
                "Supervised fine-tuning",
                f"<p>{fmt(sft.get('steps'))} steps on {fmt(sft.get('train_items'))} {html.escape(str(sft.get('data')))} "
                f"instruction items in {fmt(sft.get('train_seconds'), 3)} s ({html.escape(str(sft.get('device')))}); "
                f"held out {html.escape(str(sft.get('heldout_split')))}. Exact match on the held-out instructions:</p>"
                + _table(["instructions", "pretrained", "after SFT"], instruction_rows(s))
                + f'<p class="note">Held-out response loss (teacher-forced, nats/token): '
                f"{fmt(sft.get('heldout_response_loss_before'))} → {fmt(sft.get('heldout_response_loss_after'))}.</p>"
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
    lm_rows = lm_eval_rows(run.evals)
    if lm_rows:
        lines += ["", "## lm-evaluation-harness", "", "| " + " | ".join(LM_EVAL_HEADER) + " |"]
        lines += ["|---|---|---|---:|---:|---:|"] + ["| " + " | ".join(r) + " |" for r in lm_rows]
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
    if tracked := tracking_lines(s.get("tracking")):
        lines += ["", "## Experiment tracking", "", "| | |", "|---|---|"]
        lines += [f"| {w} | {f'[{where}]({link})' if link else f'`{where}`'} |" for w, where, link in tracked]
    if run.deaths:
        lines += deaths_markdown(run.deaths)
    return "\n".join(lines) + "\n"


def render_comparison_html(runs: list[RunData]) -> str:
    views = [r.view for r in runs]
    header, rows = comparison_rows(runs)
    sections = [
        ("Runs", _table(header, rows)),
        (
            "Loss",
            '<div class="plots">'
            + _img(plots.loss_vs_tokens(views, learners=False), "loss vs tokens")
            + _img(plots.loss_vs_time(views), "loss vs time")
            + "</div>",
        ),
        ("Merged tokens", _img(plots.merged_tokens(views), "merged tokens over time")),
        ("Rounds: quorum and grace", _img(plots.rounds(views), "quorum and grace per round")),
        ("Staleness", _img(plots.staleness(views), "staleness histogram")),
        ("Traffic", _img(plots.traffic(views), "bytes per learner")),
    ]
    return _page(f"ddiloco comparison — {len(runs)} runs", " · ".join(r.url for r in runs), sections)


def render_comparison_markdown(runs: list[RunData]) -> str:
    header, rows = comparison_rows(runs)
    lines = [f"# ddiloco comparison of {len(runs)} runs", "", "| " + " | ".join(header) + " |"]
    lines += ["|---|" + "---:|" * len(runs)] + ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# --- writing -------------------------------------------------------------------------------------------------
def _write_local(out_dir: str | Path, html_text: str, md: str, metrics: dict[str, Any]) -> dict[str, str]:
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
    store.put(keys.REPORT_HTML, html_text.encode())
    store.put(keys.REPORT_MD, md.encode())
    store.put_json(keys.REPORT_METRICS, metrics)
    paths = _write_local(out_dir, html_text, md, metrics) if out_dir is not None else {}
    log.info("report for run %s written to %s/%s", run.run_id, store.url, keys.REPORT_HTML)
    return {
        "html": html_text,
        "markdown": md,
        "metrics": metrics,
        "keys": [keys.REPORT_HTML, keys.REPORT_MD, keys.REPORT_METRICS],
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
