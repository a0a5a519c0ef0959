"""The run summary (summary.json, `ddiloco.protocol.summary.Summary`), read from the run's books in its store
alone, so any run can be audited after the fact.

- Two books are compared, not re-derived: the syncer's ledger (merged tokens per fragment) and the learners'
  reports (per incarnation and fragment: processed = merged + discarded + outstanding), an answer in flight
  settled as the learner settles it (`FragmentBooks.settled`). `ledger_balanced`: they agree and balance.
- Goodput (`ddiloco.protocol.chiptime`): learner seconds in the training loop / provisioned learner seconds;
  `merged_token_share` = merged / processed tokens (overlap steps and late answers count against it).
- Split brain, from the round records: `versions_by_multiple_epochs` counts (fragment, version) pairs named
  by records of more than one lease epoch (must be 0); `syncer_epochs`, `versions_by_epoch`.
- Data read (`ddiloco.data.shards.data_read`), efficiency (`ddiloco.posttrain.efficiency`) and the store's
  size (`store_bytes` by prefix; `global_versions_kept`) come from their own modules.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.data.shards import data_read
from ddiloco.posttrain.efficiency import fleet_efficiency, learner_efficiency
from ddiloco.protocol import chiptime
from ddiloco.protocol.learner_report import FragmentBooks, LearnerReport
from ddiloco.protocol.messages import Done, LearnerEvent, RoundRecord, SyncerState, credited
from ddiloco.protocol.summary import Summary
from ddiloco.run.globalmodel import Layout, read_layout
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store
from ddiloco.tracking.info import tracking_info

log = logging.getLogger(__name__)

Part = dict[str, Any]
"""Some of `Summary`'s fields, by name."""
Settled = list[tuple[LearnerReport, list[tuple[int, FragmentBooks]]]]
"""Every report with its fragments' books settled (`settle`)."""


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


@dataclass(slots=True)
class RunBooks:
    """What the summary reads from the store: the books as their writers keep them (the syncer's state and
    done marker, the round records, the learners' reports), typed where they have a message."""

    store: Store
    config: RunConfig
    meta: dict[str, Any]
    layout: Layout
    state: SyncerState | None
    done: Done | None
    reports: list[LearnerReport]
    records: list[RoundRecord]
    launcher: dict[str, Any]
    sizes: dict[str, int]

    @classmethod
    def read(cls, store: Store) -> RunBooks:
        saved = store.get_json_or_none(keys.SYNCER_STATE)
        done = store.get_json_or_none(keys.DONE)
        return cls(
            store=store,
            config=RunRoot.read_config(store),
            meta=store.get_json(keys.DATA_META),
            layout=read_layout(store),
            state=None if saved is None else SyncerState.from_json(saved),
            done=None if done is None else Done.from_json(done),
            reports=learner_reports(store),
            records=round_records(store),
            launcher=store.get_json_or_none(keys.LAUNCHER_EVENTS) or {},
            sizes=store.sizes(),
        )

    @property
    def P(self) -> int:
        return self.layout.num_fragments

    @property
    def end(self) -> float | None:
        """When the run ended (the done marker), else the newest report's time."""
        return self.done.time if self.done else max((r.time for r in self.reports), default=None)

    @property
    def wall(self) -> float | None:
        starts = [r.started_at for r in self.reports]
        end = self.end
        return (end - min(starts)) if (starts and end) else None


def settle(books: RunBooks) -> Settled:
    """Every report with its fragments' books settled at the summary's moment: the answer in flight merged
    when its round record credits the incarnation; the rest discarded once the incarnation trains no more
    (its final report, or the run is done), else outstanding."""
    by_round = {r.round: r for r in books.records}
    out = []
    for rep in books.reports:
        final = books.done is not None or rep.final
        fragments = []
        for p, f in rep.fragments.items():
            merge = by_round.get(f.pending.round) if f.pending is not None else None
            fragments.append(
                (int(p), f.settled(credited(merge, rep.learner_id, rep.incarnation), final=final))
            )
        out.append((rep, fragments))
    return out


def build_summary(store: Store, extra: Mapping[str, Any] | None = None) -> Summary:
    """The summary of the run at `store`; `extra`: post-training's fields (`Summary`'s evaluation fields)."""
    books = RunBooks.read(store)
    settled = settle(books)
    summary = Summary(
        **_run_fields(books),
        **_token_fields(books, settled),
        **_version_fields(books),
        **_site_fields(books, settled),
        **_learner_fields(books),
        **_syncer_fields(books),
    )
    return replace(summary, **(extra or {}))


def _run_fields(b: RunBooks) -> Part:
    d = b.config.diloco
    records = b.records
    return {
        "run_id": b.config.run_id,
        "status": "done" if b.done else "running",
        "waiting": keeper_waits(b.store),
        "finished_by": b.done.reason if b.done else None,
        "closing": (b.done.closing.to_json() if b.done.closing else {}) if b.done else None,
        "wall_seconds": b.wall,
        "learners": d.learners,
        "quorum": d.quorum,
        "num_fragments": b.P,
        "sync_every": d.sync_every,
        "steps_per_answer": _mean([c.c_steps for r in records for c in r.contributors.values()]),
        "overlap": d.overlap,
        "codec": d.codec,
        "token_budget": d.token_budget,
        "model_params": b.meta["model_params"],
        "fragment_bytes": b.layout.fragment_bytes(),
    }


def _token_fields(b: RunBooks, settled: Settled) -> Part:
    """Both books: the syncer's merged tokens per fragment and the learners' settled reports."""
    P = b.P
    processed = sum(rep.tokens_processed for rep in b.reports)
    by_learners, discarded, outstanding = [0] * P, 0, 0
    for _, fragments in settled:
        for p, f in fragments:
            by_learners[p] += f.merged_tokens
            discarded += f.discarded_tokens
            outstanding += f.c_tokens
    by_syncer = [led.merged_tokens for led in b.state.ledger] if b.state else [0] * P
    merged = sum(by_syncer) / P
    return {
        "tokens_processed": processed,
        "tokens_merged": merged,
        "tokens_discarded": discarded / P,
        "tokens_outstanding": outstanding / P,
        "tokens_merged_per_fragment": by_syncer,
        "tokens_merged_by_learners_per_fragment": by_learners,
        "ledger_balanced": by_syncer == by_learners
        and processed * P == sum(by_learners) + discarded + outstanding,
        "merged_token_share": merged / processed if processed else None,
    }


def _version_fields(b: RunBooks) -> Part:
    """Global versions as the syncer's state and the round records have them, and the store's size."""
    state, records, P = b.state, b.records, b.P
    versions = state.versions if state else [0] * P
    writers: dict[tuple[int, int], list[int]] = {}
    for r in records:
        writers.setdefault((r.fragment_id, r.version), []).append(r.epoch)
    claims = b.store.list(keys.lease_claim_prefix())
    return {
        "rounds": state.rounds_merged if state else 0,
        "rounds_abandoned": state.rounds_abandoned if state else 0,
        "global_versions": versions,
        "global_versions_contiguous": all(
            sorted(r.version for r in records if r.fragment_id == p) == list(range(1, versions[p] + 1))
            for p in range(P)
        ),
        "global_versions_kept": [len(vs) for vs in keys.global_versions_listed(list(b.sizes), P)],
        "store_bytes": sum(b.sizes.values()),
        "store_bytes_by_prefix": store_bytes_by_prefix(b.sizes),
        "versions_by_multiple_epochs": sum(len(epochs) > 1 for epochs in writers.values()),
        "syncer_epochs": sorted(e for e in map(keys.lease_epoch_of, claims) if e is not None),
        "versions_by_epoch": {str(e): n for e, n in sorted(Counter(r.epoch for r in records).items())},
    }


def _site_fields(b: RunBooks, settled: Settled) -> Part:
    """Processed and (settled) merged tokens and learner ids by site, and by learner id its incarnations."""
    merged: Counter[str] = Counter()
    processed: Counter[str] = Counter()
    ids: dict[str, set[int]] = {}
    for rep, fragments in settled:
        site = str(rep.site or "local")
        processed[site] += rep.tokens_processed
        merged[site] += sum(f.merged_tokens for _, f in fragments)
        ids.setdefault(site, set()).add(rep.learner_id)
    tokens: Counter[str] = Counter()
    for rep in b.reports:
        tokens[str(rep.learner_id)] += rep.tokens_processed
    return {
        "incarnations": {lid: incarnations(b, int(lid)) for lid in sorted(tokens)},
        "tokens_per_learner": dict(sorted(tokens.items())),
        "tokens_merged_by_site": {k: merged[k] / b.P for k in sorted(ids)},
        "tokens_processed_by_site": {k: processed[k] for k in sorted(ids)},
        "learners_by_site": {k: sorted(v) for k, v in sorted(ids.items())},
    }


def incarnations(b: RunBooks, learner_id: int) -> int:
    """Processes started as learner `learner_id`: its incarnation pointer, its claims, its reports (one killed
    before its first report still was an incarnation)."""
    pointer = b.store.get_json_or_none(keys.incarnation_key(learner_id)) or {"incarnation": -1}
    claims = len(b.store.list(keys.incarnation_claim_prefix(learner_id)))
    return max(pointer["incarnation"] + 1, claims, sum(r.learner_id == learner_id for r in b.reports))


def _learner_fields(b: RunBooks) -> Part:
    """Data read, failures and recoveries, chip time and efficiency, from the learners' reports."""
    reports, wall = b.reports, b.wall
    fired = [b.store.get_json(k) for k in b.store.list(keys.CHAOS) if k.endswith(".json")]
    chaos = sorted(b.launcher.get("chaos_events", []) + fired, key=lambda e: e.get("time_s", 0.0))
    events = b.state.learner_events if b.state else []
    accounting = learner_accounting(reports, b.done.time if b.done else None, b.P)
    never_reported = set(range(b.config.diloco.learners)) - {r.learner_id for r in reports}
    chip_time = [(a["productive_seconds"], a["provisioned_seconds"]) for a in accounting.values()]
    return {
        **data_read(reports, b.meta["num_shards"]),
        "chaos_events": chaos,
        "learner_events": events,
        "kill_recovery": kill_recovery(chaos, events, reports),
        "learner_accounting": accounting,
        "tokens_read_twice": sum(a["tokens_read_twice"] for a in accounting.values()),
        "restarts": b.launcher.get("restarts", []),
        "goodput": chiptime.goodput(chip_time, len(never_reported) * (wall or 0.0)),
        "learner_step_seconds": _mean([r.step_time_ema for r in reports if r.step_time_ema]),
        "learner_step_wall_seconds": _mean([r.step_wall_ema for r in reports if r.step_wall_ema]),
        **fleet_efficiency(reports, wall),
    }


def _syncer_fields(b: RunBooks) -> Part:
    """The syncer's counters (its state), the rounds' means (their records), its pace, tracking."""
    state, records, reports = b.state, b.records, b.reports
    pace_doc = b.store.get_json_or_none(keys.SYNCER_PACE, max_bytes=1 << 16)
    pace = pace_doc.get("figures") if isinstance(pace_doc, dict) else None
    pace = pace if isinstance(pace, dict) else {}
    return {
        "rejected_updates": state.rejected if state else {},
        "clipped_updates": state.clipped if state else {},
        "rejected_globals": dict(sum((Counter(r.rejected_globals) for r in reports), Counter())),
        "bytes_uploaded": sum(r.bytes_up for r in reports),
        "bytes_downloaded": sum(r.bytes_down for r in reports),
        "bytes_published": state.bytes_published if state else 0,
        "late_answers": state.late_answers if state else 0,
        "mean_quorum": _mean([r.quorum for r in records]),
        "mean_grace_seconds": _mean([r.grace_s for r in records]),
        "mean_time_to_quorum_seconds": _mean([r.time_to_quorum for r in records]),
        "mean_staleness": _mean([c.staleness for r in records for c in r.contributors.values()]),
        "syncer_lag": pace.get("syncer_lag"),
        "sync_pace": pace,
        "entropy_floor": b.meta.get("entropy_floor"),
        "tracking": tracking_info(b.store),
    }


def learner_accounting(reports: list[LearnerReport], end: float | None, P: int) -> dict[str, dict[str, Any]]:
    """Per learner: seconds provisioned, up, in the training loop (`productive`, `ddiloco.protocol.chiptime`) and
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
