"""The run summary, computed from the store alone (DESIGN §6), so any run can be audited after the fact.

Design choices:
- Two independent books are kept and compared: the syncer's ledger (tokens of every merged answer, per
  fragment) and the learners' reports (per incarnation: processed = merged + discarded + outstanding, per
  fragment). An answer still pending in a dead learner's last report is settled here from the round
  records. `ledger_balanced` is true only when both books agree on merged tokens for every fragment.
- Goodput is the paper's quantity (`ddiloco.chiptime`): learner seconds spent in the training loop /
  provisioned learner seconds (each learner id from when it first joined to the end of the run, M × the wall
  time for a provisioned id that never reported); kills, restarts, rejoins and stalls are the lost part, so a
  run without failures comes close to 1. `merged_token_share` = tokens merged / tokens processed: the overlap
  steps that α = 0 overwrites and late answers count against it, not against goodput.
- Split brain is audited from the round records (write-once, one per merged round, each naming its writer's
  lease epoch): `versions_by_multiple_epochs` counts the (fragment, version) pairs named by more than one
  record (two syncers published that version; must be 0), `syncer_epochs` lists the epochs claimed in the
  lease and `versions_by_epoch` how many versions each one published.
- Which data each learner read (`ddiloco.shards.data_read`): `data_read` per learner id (shard, its token
  range, own or shared, epochs of it, tokens processed), `shared_shards` (shard -> learner ids that read
  it, when more than one did; empty in a run where every learner had a shard of its own), `unread_shards`.
- `steps_per_answer`: mean over merged answers (round records) of the inner steps each covered, to compare
  with H (`sync_every`).
- Efficiency (`ddiloco.posttrain.efficiency`): `processed_tokens_per_s`, `mfu`, `data_wait_fraction`,
  `peak_memory_bytes` (and its kind) for the fleet at the top level and per learner in `learner_accounting`.
- `store_bytes` is the size of every object in the run root when the summary is built (one listing with
  sizes, `Store.sizes`), `store_bytes_by_prefix` splits it by top-level prefix (`syncer/` by its
  sub-prefix: momentum, rounds), and `global_versions_kept` counts the global versions each fragment still
  has: what retention (`ddiloco.retention`) bounds.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from typing import Any

from ddiloco import chiptime, keys
from ddiloco.posttrain.efficiency import fleet_efficiency, learner_efficiency
from ddiloco.protocol import messages
from ddiloco.protocol.fields import plain
from ddiloco.protocol.learner_report import LearnerReport
from ddiloco.protocol.messages import LearnerEvent, RoundRecord, SyncerState
from ddiloco.shards import data_read
from ddiloco.store.base import Store
from ddiloco.tracking.info import tracking_info

log = logging.getLogger(__name__)

CLOSING_FIELDS = ("closing_rounds", "closing_rounds_merged", "closing_seconds", "closing_tokens_merged")
"""What the done marker says about the run's closing rounds (`ddiloco.syncer.drain`)."""


def read_reports(store: Store) -> list[dict[str, Any]]:
    """Every learner report as stored (JSON, what the report pages draw); the summary reads them typed."""
    return [store.get_json(k) for k in store.list(keys.LEARNERS) if keys.is_report_key(k)]


def read_round_records(store: Store) -> list[dict[str, Any]]:
    """Every round record as stored (JSON, what the report pages and the curve draw); typed: `round_records`."""
    return [store.get_json(k) for k in store.list(keys.ROUNDS)]


def keeper_waits(store: Store) -> dict[str, dict[str, Any]]:
    """Workers waiting to be scheduled, by keeper (`learner-0`, `syncer`): what their keepers last noted
    (`ddiloco.components.keeper_note`: why, e.g. a Kueue queue without quota, and since when)."""
    out: dict[str, dict[str, Any]] = {}
    for key in store.list(keys.KEEPER):
        doc = store.get_json_or_none(key, max_bytes=1 << 16)
        if isinstance(doc, dict) and doc.get("waiting"):
            out[key.removeprefix(keys.KEEPER).removesuffix(".json")] = doc
    return out


def learner_reports(store: Store) -> list[LearnerReport]:
    """Every learner report that reads, typed; one that does not (a learner pod can write any JSON under
    its prefix) is left out with a warning naming it and the field, as the syncer leaves it out."""
    out = []
    for k in store.list(keys.LEARNERS):
        if not keys.is_report_key(k):
            continue
        try:
            out.append(LearnerReport.from_json(store.get_json(k)))
        except ValueError as e:
            log.warning("summary: leaving out learner report %s (%s)", k, e)
    return out


def round_records(store: Store) -> list[RoundRecord]:
    """Every round record, typed (`RoundRecord.from_json`)."""
    return [RoundRecord.from_json(store.get_json(k), k) for k in store.list(keys.ROUNDS)]


def store_bytes_by_prefix(sizes: dict[str, int]) -> dict[str, int]:
    """Bytes by top-level prefix (`global/`, `updates/`, ...; `syncer/momentum/` and the other `syncer/`
    sub-prefixes apart; objects at the root under "")."""
    out: Counter[str] = Counter()
    for key, n in sizes.items():
        parts = key.split("/")
        deep = parts[0] == "syncer" and len(parts) > 2
        out["" if len(parts) == 1 else "/".join(parts[: 2 if deep else 1]) + "/"] += n
    return dict(sorted(out.items()))


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def build_summary(store: Store, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = store.get_json(keys.CONFIG)
    meta = store.get_json(keys.DATA_META)
    layout = store.get_json(keys.LAYOUT)
    saved = store.get_json_or_none(keys.SYNCER_STATE)
    state = None if saved is None else SyncerState.from_json(saved)
    pace_doc = store.get_json_or_none(keys.SYNCER_PACE, max_bytes=1 << 16)
    pace = pace_doc.get("figures") if isinstance(pace_doc, dict) else None
    pace = pace if isinstance(pace, dict) else {}
    done = store.get_json_or_none(keys.DONE)
    events = store.get_json_or_none(keys.LAUNCHER_EVENTS) or {}
    reports = learner_reports(store)
    fired = [store.get_json(k) for k in store.list(keys.CHAOS) if k.endswith(".json")]
    chaos_events = sorted(events.get("chaos_events", []) + fired, key=lambda e: e.get("time_s", 0.0))
    records = round_records(store)
    sizes = store.sizes()
    P = len(layout["fragments"])
    M = cfg["diloco"]["learners"]
    by_round = {r.round: r for r in records}

    processed = merged_l = discarded = outstanding = 0
    merged_seconds = 0.0
    learner_merged_per_frag = [0] * P
    per_learner: dict[str, dict[str, Any]] = {}
    by_site: dict[str, dict[str, Any]] = {}  # site -> merged (fragment-tokens), processed, learner ids
    for rep in reports:
        site = by_site.setdefault(str(rep.site or "local"), {"merged": 0, "processed": 0, "ids": set()})
        site["processed"] += rep.tokens_processed
        site["ids"].add(rep.learner_id)
        alive = done is None and not rep.final
        processed += rep.tokens_processed
        for p_str, f in rep.fragments.items():
            p = int(p_str)
            m_tok, m_sec = f.merged_tokens, f.merged_seconds
            pend = f.pending
            credited = 0
            if pend is not None:
                if messages.credited(by_round.get(pend.round), rep.learner_id, rep.incarnation):
                    credited = pend.tokens
                    m_sec += pend.seconds
            m_tok += credited
            learner_merged_per_frag[p] += m_tok
            merged_l += m_tok
            site["merged"] += m_tok
            merged_seconds += m_sec
            rest = f.c_tokens - credited
            if alive:
                outstanding += rest
                discarded += f.discarded_tokens
            else:
                discarded += f.discarded_tokens + rest
        lid = str(rep.learner_id)
        entry = per_learner.setdefault(lid, {"incarnations": 0, "tokens": 0})
        entry["tokens"] += rep.tokens_processed
    for lid, entry in per_learner.items():
        # Count started processes, not reports: one killed before its first report still was an incarnation.
        pointer = store.get_json_or_none(keys.incarnation_key(int(lid))) or {"incarnation": -1}
        claims = len(store.list(keys.incarnation_claim_prefix(int(lid))))
        entry["incarnations"] = max(
            pointer["incarnation"] + 1, claims, sum(r.learner_id == int(lid) for r in reports)
        )

    syncer_per_frag = [led.merged_tokens for led in state.ledger] if state else [0] * P
    starts = [r.started_at for r in reports]
    end = done["time"] if done else max((r.time for r in reports), default=None)
    wall = (end - min(starts)) if (starts and end) else None
    versions = state.versions if state else [0] * P
    contiguous = all(
        sorted(r.version for r in records if r.fragment_id == p) == list(range(1, versions[p] + 1))
        for p in range(P)
    )
    writers: dict[tuple[int, int], list[int]] = {}
    for r in records:
        writers.setdefault((r.fragment_id, r.version), []).append(r.epoch)
    step_times = [r.step_time_ema for r in reports if r.step_time_ema]
    step_walls = [r.step_wall_ema for r in reports if r.step_wall_ema]
    accounting = learner_accounting(reports, done["time"] if done else None, P)
    never_reported = set(range(M)) - {r.learner_id for r in reports}
    learner_events = state.learner_events if state else []
    tokens_merged = sum(syncer_per_frag) / P
    summary: dict[str, Any] = {
        "run_id": cfg["run_id"],
        "status": "done" if done else "running",
        "waiting": keeper_waits(store),
        "finished_by": done.get("reason", "budget") if done else None,
        "closing": {k: done[k] for k in CLOSING_FIELDS if k in done} if done else None,
        "wall_seconds": wall,
        "learners": M,
        "quorum": cfg["diloco"]["quorum"],
        "num_fragments": P,
        "sync_every": cfg["diloco"]["sync_every"],
        "steps_per_answer": _mean([c.c_steps for r in records for c in r.contributors.values()]),
        "overlap": cfg["diloco"]["overlap"],
        "codec": cfg["diloco"]["codec"],
        "token_budget": cfg["diloco"]["token_budget"],
        "model_params": meta["model_params"],
        "fragment_bytes": [f["numel"] * 4 for f in layout["fragments"]],
        "tokens_processed": processed,
        "tokens_merged": tokens_merged,
        "tokens_discarded": discarded / P,
        "tokens_outstanding": outstanding / P,
        "tokens_merged_per_fragment": syncer_per_frag,
        "tokens_merged_by_learners_per_fragment": learner_merged_per_frag,
        "ledger_balanced": syncer_per_frag == learner_merged_per_frag
        and processed * P == merged_l + discarded + outstanding,
        "rounds": state.rounds_merged if state else 0,
        "rounds_abandoned": state.rounds_abandoned if state else 0,
        "global_versions": versions,
        "global_versions_contiguous": contiguous,
        "global_versions_kept": [len(vs) for vs in keys.global_versions_listed(list(sizes), P)],
        "store_bytes": sum(sizes.values()),
        "store_bytes_by_prefix": store_bytes_by_prefix(sizes),
        "versions_by_multiple_epochs": sum(len(epochs) > 1 for epochs in writers.values()),
        "syncer_epochs": sorted(
            e for e in map(keys.lease_epoch_of, store.list(keys.lease_claim_prefix())) if e is not None
        ),
        "versions_by_epoch": {str(e): n for e, n in sorted(Counter(r.epoch for r in records).items())},
        "incarnations": {k: v["incarnations"] for k, v in sorted(per_learner.items())},
        "tokens_per_learner": {k: v["tokens"] for k, v in sorted(per_learner.items())},
        "tokens_merged_by_site": {k: v["merged"] / P for k, v in sorted(by_site.items())},
        "tokens_processed_by_site": {k: v["processed"] for k, v in sorted(by_site.items())},
        "learners_by_site": {k: sorted(v["ids"]) for k, v in sorted(by_site.items())},
        **data_read(reports, meta["num_shards"]),
        "chaos_events": chaos_events,
        "learner_events": plain(learner_events),
        "kill_recovery": kill_recovery(chaos_events, learner_events, reports),
        "learner_accounting": accounting,
        "tokens_read_twice": sum(a["tokens_read_twice"] for a in accounting.values()),
        "restarts": events.get("restarts", []),
        "rejected_updates": state.rejected if state else {},
        "clipped_updates": state.clipped if state else {},
        "rejected_globals": dict(sum((Counter(r.rejected_globals) for r in reports), Counter())),
        "bytes_uploaded": sum(r.bytes_up for r in reports),
        "bytes_downloaded": sum(r.bytes_down for r in reports),
        "bytes_published": state.bytes_published if state else 0,
        "late_answers": state.late_answers if state else 0,
        "goodput": chiptime.goodput(
            [(a["productive_seconds"], a["provisioned_seconds"]) for a in accounting.values()],
            len(never_reported) * (wall or 0.0),
        ),
        "merged_token_share": tokens_merged / processed if processed else None,
        "learner_step_seconds": _mean(step_times),
        "learner_step_wall_seconds": _mean(step_walls),
        **fleet_efficiency(reports, wall),
        "mean_quorum": _mean([r.quorum for r in records]),
        "mean_grace_seconds": _mean([r.grace_s for r in records]),
        "mean_time_to_quorum_seconds": _mean([r.time_to_quorum for r in records]),
        "mean_staleness": _mean([c.staleness for r in records for c in r.contributors.values()]),
        "syncer_lag": pace.get("syncer_lag"),
        "sync_pace": pace,
        "entropy_floor": meta.get("entropy_floor"),
        "tracking": tracking_info(store),
        "initial_val_loss": None,
        "final_val_loss": None,
        "sft_val_loss": None,
        "task_accuracy": None,
    }
    summary.update(extra or {})
    return summary


def learner_accounting(reports: list[LearnerReport], end: float | None, P: int) -> dict[str, dict[str, Any]]:
    """Per learner: seconds provisioned, up, in the training loop (`productive`, `ddiloco.chiptime`) and
    computing inner steps (`training`), its goodput, the share of its tokens that were merged, the peak
    resident memory of its largest incarnation (None when its reports predate the field), the tokens
    its restarts read again (`read_twice`) and its efficiency (`ddiloco.posttrain.efficiency`)."""
    out: dict[str, dict[str, Any]] = {}
    for lid in sorted({r.learner_id for r in reports}):
        incs = sorted((r for r in reports if r.learner_id == lid), key=lambda r: r.incarnation)
        productive, provisioned = chiptime.learner_chip_time(incs, end)
        processed = sum(r.tokens_processed for r in incs)
        merged = sum(f.merged_tokens for r in incs for f in r.fragments.values()) / P
        rss = [r.peak_rss_bytes for r in incs if r.peak_rss_bytes]
        out[str(lid)] = {
            "incarnations": len(incs),
            "provisioned_seconds": provisioned,
            "productive_seconds": productive,
            "goodput": productive / provisioned if provisioned > 0 else None,
            "up_seconds": sum(r.time - r.started_at for r in incs),
            "training_seconds": sum(r.busy_seconds for r in incs),
            "merged_seconds": sum(f.merged_seconds for r in incs for f in r.fragments.values()) / P,
            "tokens_processed": processed,
            "merged_token_share": merged / processed if processed else None,
            "peak_rss_bytes": max(rss, default=None),
            "tokens_read_twice": read_twice(incs),
            **learner_efficiency(incs),
        }
    return out


def read_twice(incarnations: list[LearnerReport]) -> int:
    """Tokens a learner's incarnations read again that an earlier one had reported as read (in incarnation
    order: how far behind the furthest reported position each one started). 0 when every restart resumed
    from its predecessor's last report (`ddiloco.learner.resume`); reports without `data.started` count 0."""
    twice, reached = 0.0, None
    for r in incarnations:
        d = r.data
        if d is None:
            continue
        if reached is not None and d.started is not None:
            twice += max(0.0, reached - d.started) * (d.end - d.start)
        reached = max(reached or 0.0, d.epochs)
    return round(twice)


def kill_recovery(
    chaos_events: list[dict], learner_events: list[LearnerEvent], reports: list[LearnerReport]
) -> list[dict[str, Any]]:
    """For each learner kill: seconds until the syncer noticed (`lost`) and until a new incarnation joined."""
    out = []
    for ev in chaos_events:
        if (
            ev.get("kind") != "kill_learner"
            or "fired_at" not in ev
            or str(ev.get("action", "")).startswith("skipped")
        ):
            continue
        lid, t = ev["learner"], ev["fired_at"]
        lost = [
            e.time
            for e in learner_events
            if e.event == "lost" and e.learner.split("-")[0] == str(lid) and e.time >= t
        ]
        joined = [r.joined_at for r in reports if r.learner_id == lid and r.joined_at and r.joined_at > t]
        out.append(
            {
                "event": ev.get("id"),
                "learner": lid,
                "detect_seconds": (min(lost) - t) if lost else None,
                "rejoin_seconds": (min(joined) - t) if joined else None,
            }
        )
    return out
