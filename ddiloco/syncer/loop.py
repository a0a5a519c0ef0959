"""The syncer: a CPU-only loop that opens rounds, collects learner answers, merges and publishes fragments.

Design choices:
- Syncer-clocked rounds go round-robin over fragments (p = s mod P). A round opens every (H/P)·ξ_step
  seconds, at most τ rounds in flight, never two for the same fragment, and a fragment's round no sooner than
  H·ξ_step after its previous version was published, so an answer covers about H learner steps (the merge's
  latency is not taken out of them). ξ_step is the median of the live learners' *wall* seconds per step, the
  loop's overhead included, each measured on the learner's own clock (`ddiloco.chiptime`): compute time alone
  would open rounds faster than every H/P real steps.
- A round merges once K answers arrived and the adaptive grace window
  clamp(γ·(τ·(H/P)·ξ_step − ξ_quorum − ξ_sync), 0, cap) has passed (or every live learner answered).
- Answers are parsed and validated as they arrive (`ddiloco.syncer.intake`; every rule and reason is listed in
  `ddiloco.protocol.validation`), so a merge only does arithmetic. A rejected object never touches the global
  model; it is counted by reason (state, metrics, summary), and the learner it authentically came from is
  told through a bounded `rejections` list in the status object.
- With the run key every update must carry a valid signature, and everything the syncer publishes (global
  versions, outer momentum, the final model) is signed.
- Robust mode (`robust_clip`) clips outer gradients above robust_clip × the round's median norm; clipped
  answers are still merged and counted under `clipped` (state, status, metrics, round record).
- Persist order per merge: outer momentum → round record → global payload + latest pointer → status →
  state. A restarted syncer that finds a newer global than its state adopts it (and its round record), so
  it never publishes a version twice and never loses a merged one.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import Counter, deque
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from ddiloco import chiptime, keys
from ddiloco.globalmodel import latest_version, publish_global, read_global, read_layout
from ddiloco.hostname import host_name
from ddiloco.merge import OuterNesterov, merge_with_stats, token_weight
from ddiloco.metrics import SyncerMetrics
from ddiloco.prepare import load_run_config
from ddiloco.protocol import signing, validation, wire
from ddiloco.store import NotFound, ObjectTooLarge, Store, StoreError
from ddiloco.syncer.intake import Intake, Round

log = logging.getLogger(__name__)

DEFAULT_STEP_S = 0.05
KEEP_VERSIONS = 4
MAX_NOTICES = 64


class Syncer(Intake):
    def __init__(
        self,
        store: Store,
        *,
        clock=time.monotonic,
        wall=time.time,
        poll_s: float = 0.02,
        registry: CollectorRegistry | None = None,
        secret: bytes | None = None,
        robust_clip: float | None = None,
    ) -> None:
        """`secret`: the master key from DDILOCO_RUN_KEY (None: unsigned). `robust_clip`: robust mode
        factor; default `cfg.diloco.robust_clip` when the config has it."""
        self.store, self.clock, self.wall, self.poll_s = store, clock, wall, poll_s
        self.cfg = load_run_config(store)
        self.run_id = self.cfg.run_id
        self.key = signing.for_run(secret, self.run_id)
        if self.key is None:
            signing.warn_unsigned("syncer")
        self.robust_clip = robust_clip if robust_clip is not None else self.cfg.diloco.robust_clip
        self.clipped: Counter[str] = Counter()
        self.notices: deque[dict[str, Any]] = deque(maxlen=MAX_NOTICES)
        self.step_clock = validation.StepClock()
        self.published_at: dict[tuple[int, int], float] = {}
        self.merged_clock: dict[int, float] = {}
        """fragment -> this syncer's `clock()` when its newest version was published (round pacing)."""
        self.layout = read_layout(store)
        d = self.cfg.diloco
        self.P = self.layout.num_fragments
        self.tokens_per_step = self.cfg.train.max_batch() * self.cfg.model.seq_len
        self.globals: list[dict[str, torch.Tensor]] = []
        self.recent: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in range(self.P)]
        self.versions = [0] * self.P
        self.outer = [OuterNesterov(lr=d.outer_lr, momentum=d.outer_momentum) for _ in range(self.P)]
        self.ledger = [{"merged_tokens": 0, "merged_answers": 0, "merged_steps": 0} for _ in range(self.P)]
        self.rejected: Counter[str] = Counter()
        self.open: dict[int, Round] = {}
        self.next_round = 0
        self.rounds_merged = 0
        self.rounds_abandoned = 0
        self.merged_recent: deque[dict[str, Any]] = deque(maxlen=8 * self.P + 16)
        self.xi_quorum = 0.0
        self.xi_sync = 0.0
        self.last_open = -math.inf
        self.learners: dict[int, dict[str, Any]] = {}
        self.heard: dict[int, tuple[tuple[int, int], float]] = {}
        """learner id -> ((incarnation, seq) of its newest report, this syncer's `clock()` when it changed)."""
        self.past_reports: dict[str, dict[str, Any]] = {}
        """report key -> the last report of an incarnation no longer its learner's newest (for goodput)."""
        self._next_refresh = 0.0
        self.bytes_published = 0
        self.late_answers = 0
        self.learner_events: list[dict[str, Any]] = []
        self._live_prev: set[str] = set()
        self.incarnation = 0
        self.started_wall = wall()
        self._restore()
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = SyncerMetrics(self.registry, self.metrics_state)

    # --- state ------------------------------------------------------------------------------------------------
    def _restore(self) -> None:
        state = self.store.get_json_or_none(keys.SYNCER_STATE)
        if state is not None:
            if state.get("run_id") != self.run_id:
                raise ValueError(
                    f"{keys.SYNCER_STATE} belongs to run {state.get('run_id')!r}, not {self.run_id!r}"
                )
            self.incarnation = int(state["incarnation"]) + 1
            self.versions = [int(v) for v in state["versions"]]
            self.ledger = state["ledger"]
            self.rejected = Counter(state["rejected"])
            self.clipped = Counter(state.get("clipped", {}))
            self.next_round = int(state["next_round"])
            self.rounds_merged, self.rounds_abandoned = (
                int(state["rounds_merged"]),
                int(state["rounds_abandoned"]),
            )
            self.merged_recent.extend(state["merged_recent"])
            self.xi_quorum, self.xi_sync = float(state["xi_quorum"]), float(state["xi_sync"])
            self.bytes_published, self.late_answers = (
                int(state["bytes_published"]),
                int(state["late_answers"]),
            )
            self.started_wall = float(state["started_wall"])
            self.learner_events = list(state.get("learner_events", []))
            for r in state.get("open_rounds", []):  # resume collecting; answers are re-read from the store
                self.open[r["round"]] = Round(r["round"], r["fragment_id"], self.clock(), r["opened_wall"])
        # A merge whose state write did not happen: adopt the newer published version and its ledger entry.
        for p in range(self.P):
            latest = latest_version(self.store, p)
            if latest is None:
                raise NotFound(f"fragment {p} has no global version 0; run `ddiloco prepare` first")
            if latest > self.versions[p]:
                try:  # the pointer is unsigned: adopt only a version that verifies
                    read_global(self.store, self.run_id, self.layout, p, latest, key=self.key)
                except (wire.PayloadError, NotFound) as e:
                    log.error("syncer: not adopting fragment %d version %d (%s)", p, latest, e)
                    continue
                self._adopt_unrecorded(p, latest)
        self.globals = [
            read_global(self.store, self.run_id, self.layout, p, v, key=self.key)
            for p, v in enumerate(self.versions)
        ]
        for p, v in enumerate(self.versions):
            self.recent[p][v] = {n: t.clone() for n, t in self.globals[p].items()}
            if v > 0:
                self._restore_momentum(p, v)
        if state is not None:
            log.info(
                "syncer incarnation %d resumed run %s at round %d, versions %s",
                self.incarnation,
                self.run_id,
                self.next_round,
                self.versions,
            )

    def _restore_momentum(self, p: int, v: int) -> None:
        """Outer momentum of fragment p at version v; one that fails verification restarts from zero."""
        try:
            payload = wire.unpack(
                self.store.get(keys.momentum_key(p, v), max_bytes=self.layout.fragment_max_bytes(p)),
                expect={"run_id": self.run_id, "kind": "momentum", "fragment_id": p, "version": v},
                key=self.key,
            )
            if any(list(t.shape) != self.layout.shapes.get(n) for n, t in payload.tensors.items()):
                raise wire.PayloadError("wrong_shape", "momentum does not match the fragment layout")
            self.outer[p].load_state_dict(payload.tensors)
        except (wire.PayloadError, NotFound, ObjectTooLarge, ValueError) as e:
            log.error(
                "syncer: outer momentum of fragment %d v%d unusable (%s); restarting it from zero", p, v, e
            )
            self.outer[p] = OuterNesterov(
                lr=self.cfg.diloco.outer_lr, momentum=self.cfg.diloco.outer_momentum
            )

    def _adopt_unrecorded(self, p: int, latest: int) -> None:
        for key in self.store.list("syncer/rounds/"):
            rec = self.store.get_json(key)
            if rec["fragment_id"] == p and self.versions[p] < rec["version"] <= latest:
                self._account(rec)
                self.next_round = max(self.next_round, rec["round"] + 1)
                self.open.pop(rec["round"], None)
        log.warning(
            "syncer: adopting fragment %d version %d published before the last state write", p, latest
        )
        self.versions[p] = latest

    def _account(self, rec: dict[str, Any]) -> None:
        led = self.ledger[rec["fragment_id"]]
        for c in rec["contributors"].values():
            led["merged_tokens"] += c["c_tokens"]
            led["merged_steps"] += c["c_steps"]
            led["merged_answers"] += 1
        self.rounds_merged += 1
        self.merged_recent.append(
            {
                "round": rec["round"],
                "fragment_id": rec["fragment_id"],
                "version": rec["version"],
                "contributors": {k: v["c_tokens"] for k, v in rec["contributors"].items()},
            }
        )

    def _save_state(self) -> None:
        self.store.put_json(
            keys.SYNCER_STATE,
            {
                "run_id": self.run_id, "incarnation": self.incarnation, "versions": self.versions, "ledger": self.ledger,
                "rejected": dict(self.rejected), "clipped": dict(self.clipped), "next_round": self.next_round, "rounds_merged": self.rounds_merged,
                "rounds_abandoned": self.rounds_abandoned, "merged_recent": list(self.merged_recent),
                "xi_quorum": self.xi_quorum, "xi_sync": self.xi_sync, "started_wall": self.started_wall,
                "open_rounds": [{"round": r.round, "fragment_id": r.fragment_id, "opened_wall": r.opened_wall} for r in self.open.values()],
                "bytes_published": self.bytes_published, "late_answers": self.late_answers,
                "learner_events": self.learner_events,
            },
        )  # fmt: skip

    def metrics_state(self) -> dict[str, Any]:
        """What the metrics collector exports at scrape time, derived from the syncer's own books."""
        reports = list(self.learners.values())
        discarded = sum(f["discarded_tokens"] for r in reports for f in r["fragments"].values()) / self.P
        processed = sum(r.get("tokens_processed") or 0 for r in [*reports, *list(self.past_reports.values())])
        return {
            "tokens_merged": self.tokens_merged(),
            "tokens_discarded": discarded,
            "token_budget": self.cfg.diloco.token_budget,
            "live_learners": len(self.live_learners()),
            "goodput": self.goodput_so_far(),
            "merged_token_share": min(self.tokens_merged() / processed, 1.0) if processed else 0.0,
            "versions": list(self.versions),
        }

    def goodput_so_far(self) -> float:
        """The paper's goodput up to now (`ddiloco.chiptime`). A live learner's books end at its newest
        report; a dead one's are extended by the time since its report last changed, on this syncer's clock
        (never by comparing this host's clock with the learner's)."""
        learners, past, heard = dict(self.learners), list(self.past_reports.values()), dict(self.heard)
        live = {r["learner_id"] for r in self.live_learners()}  # copies: a scrape runs on another thread
        now, per_learner = self.clock(), []
        for lid, newest in learners.items():
            incs = [newest, *(r for r in past if r["learner_id"] == lid)]
            down = 0.0 if lid in live or lid not in heard else now - heard[lid][1]
            per_learner.append(chiptime.learner_chip_time(incs, newest["time"] + down))
        return chiptime.goodput(per_learner) or 0.0

    def tokens_merged(self) -> float:
        return sum(led["merged_tokens"] for led in self.ledger) / self.P

    def publish_status(self, done: bool = False) -> None:
        live = self.live_learners()
        self.store.put_json(
            keys.STATUS,
            {
                "run_id": self.run_id, "time": self.wall(), "syncer_incarnation": self.incarnation, "done": done,
                "syncer_host": host_name(), "syncer_pid": os.getpid(),
                "next_round": self.next_round, "versions": {str(p): v for p, v in enumerate(self.versions)},
                "open_rounds": [{"round": r.round, "fragment_id": r.fragment_id, "opened_at": r.opened_wall} for r in self.open.values()],
                "merged": list(self.merged_recent), "tokens_merged": self.tokens_merged(),
                "token_budget": self.cfg.diloco.token_budget, "rounds_merged": self.rounds_merged,
                "live_learners": len(live), "loss": statistics.mean([r["loss_ema"] for r in live if r.get("loss_ema") is not None] or [math.nan]),
                "rejected": dict(self.rejected), "clipped": dict(self.clipped), "rejections": list(self.notices),
            },
        )  # fmt: skip

    # --- learners ---------------------------------------------------------------------------------------------
    def refresh_learners(self) -> None:
        newest: dict[int, str] = {}
        found = [
            k
            for k in self.store.list("learners/")
            if k.endswith("/report.json") and k.split("/")[1].isdigit()
        ]
        for key in found:
            lid = int(key.split("/")[1])
            newest[lid] = max(newest.get(lid, key), key)
        for key in set(found) - set(newest.values()) - set(self.past_reports):
            self._read_past_report(key, int(key.split("/")[1]))
        for lid, key in newest.items():
            report = self._read_report(key, lid)
            if report is not None:
                self.learners[lid] = report
                mark = (int(report["incarnation"]), int(report.get("seq") or 0))
                if lid not in self.heard or self.heard[lid][0] != mark:
                    self.heard[lid] = (mark, self.clock())

        live = {keys.contributor(r["learner_id"], r["incarnation"]) for r in self.live_learners()}
        now = self.wall()
        for c in sorted(live - self._live_prev):
            self.learner_events.append({"event": "joined", "learner": c, "time": now})
        for c in sorted(self._live_prev - live):
            self.learner_events.append({"event": "lost", "learner": c, "time": now})
        self._live_prev = live

    def _read_report(self, key: str, lid: int) -> dict[str, Any] | None:
        """A learner report that reads and validates, else None (logged)."""
        try:
            report = self.store.get_json(key)
        except StoreError as e:
            log.debug("report %s unreadable (%s)", key, e)
            return None
        if not validation.report_ok(report, lid):
            log.warning("syncer: ignoring malformed learner report %s", key)
            return None
        return report

    def _read_past_report(self, key: str, lid: int) -> None:
        """Once, when an incarnation is superseded (or found so at start): its books for goodput."""
        report = self._read_report(key, lid)
        if report is not None:
            keep = ("learner_id", "incarnation", "time", "started_at", "joined_at", "final", "exit_reason")
            self.past_reports[key] = {k: report.get(k) for k in keep} | {
                "tokens_processed": report.get("tokens_processed") or 0,
                "productive_seconds": chiptime.productive_seconds(report),
            }

    def live_learners(self) -> list[dict[str, Any]]:
        """Learners whose report changed recently (five missed heartbeats mean dead) and is not final.

        Judged on this syncer's own clock only: when it *saw* a report change, never the report's `time`,
        which the learner's host wrote with its own clock (a host whose clock runs 30 s behind would never
        look live, and with every learner behind no round would ever open)."""
        now, timeout = self.clock(), max(3.0, 5 * self.cfg.train.heartbeat_every_s)
        return [
            r
            for lid, r in self.learners.items()
            if not r.get("final") and lid in self.heard and now - self.heard[lid][1] < timeout
        ]

    def xi_step(self) -> float:
        """Median wall seconds per step of the live learners, loop overhead included (`chiptime.cadence`)."""
        return self._measured_step() or DEFAULT_STEP_S

    def _measured_step(self) -> float | None:
        times = [t for r in self.live_learners() if (t := chiptime.cadence(r))]
        return statistics.median(times) if times else None

    def grace_window(self) -> float:
        """clamp(γ·(τ·ξ_round − ξ_quorum − ξ_sync), 0, cap) with ξ_round = (H/P)·ξ_step, the time between two
        rounds: a learner keeps training for τ rounds before it needs the merged result. With the paper's
        H = P this is DESIGN's τ·ξ_step; with H/P steps per round, τ·ξ_step alone would shrink the window to
        nothing as soon as answers take longer than a step to arrive (learners behind slow links)."""
        g, d = self.cfg.diloco.grace, self.cfg.diloco
        if g is None:
            return 0.0
        xi_round = max(d.sync_every / self.P, 1.0) * self.xi_step()
        raw = g.gamma * (d.overlap * xi_round - self.xi_quorum - self.xi_sync)
        return min(max(raw, 0.0), g.cap_seconds)

    def _ema(self, old: float, new: float) -> float:
        a = self.cfg.diloco.grace.ema if self.cfg.diloco.grace is not None else 0.2
        return new if old == 0.0 else (1 - a) * old + a * new

    # --- rounds -----------------------------------------------------------------------------------------------
    def maybe_open_round(self, now: float) -> None:
        d = self.cfg.diloco
        if len(self.open) >= d.overlap or not self.live_learners():
            return
        measured = self._measured_step()
        xi = measured or DEFAULT_STEP_S
        p = self.next_round % self.P
        if now - self.last_open < (d.sync_every / self.P) * xi or any(
            r.fragment_id == p for r in self.open.values()
        ):
            return
        since_merge = now - self.merged_clock.get(p, -math.inf)
        if measured is not None and since_merge < d.sync_every * xi:  # learners still train on the version
            return
        self.open[self.next_round] = Round(self.next_round, p, now, self.wall())
        self.next_round += 1
        self.last_open = now
        self.publish_status()

    def layout_numel(self, name: str) -> int:
        return math.prod(self.layout.shapes[name])

    def _base(self, p: int, version: int) -> dict[str, torch.Tensor]:
        if version not in self.recent[p]:
            self.recent[p][version] = read_global(
                self.store, self.run_id, self.layout, p, version, key=self.key
            )
        return self.recent[p][version]

    def progress(self, rnd: Round, now: float) -> None:
        self.collect(rnd)
        d = self.cfg.diloco
        if rnd.quorum_at is None:
            if len(rnd.answers) >= d.quorum:
                rnd.quorum_at = now
                self.xi_quorum = self._ema(self.xi_quorum, now - rnd.opened_at)
                rnd.grace_s = self.grace_window()
            elif now - rnd.opened_at > d.round_timeout_s:
                log.warning(
                    "syncer: round %d (fragment %d) abandoned: %d of %d answers",
                    rnd.round,
                    rnd.fragment_id,
                    len(rnd.answers),
                    d.quorum,
                )
                self.rounds_abandoned += 1
                self.metrics.rounds.labels(outcome="abandoned").inc()
                del self.open[rnd.round]
                self.store.delete_prefix(keys.update_prefix(rnd.fragment_id, rnd.round))
                self.publish_status()
            return
        live = {keys.contributor(r["learner_id"], r["incarnation"]) for r in self.live_learners()}
        if now >= rnd.quorum_at + rnd.grace_s or live <= set(rnd.answers):
            self.merge(rnd, now)

    def merge(self, rnd: Round, now: float) -> None:
        p, d = rnd.fragment_id, self.cfg.diloco
        theta = self.globals[p]
        outer_grads, weights, contributors = [], [], {}
        for c, ans in sorted(rnd.answers.items()):
            base = self._base(p, ans.header["base_version"])
            outer_grads.append({n: theta[n] - base[n] - ans.delta[n] for n in theta})  # Δ_m = Θ_p − θ_m
            w = token_weight(ans.header["c_tokens"], ans.header["c_steps"]) if d.token_weighting else 1.0
            weights.append(w)
            contributors[c] = {
                "c_tokens": ans.header["c_tokens"], "c_steps": ans.header["c_steps"], "c_seconds": ans.header["c_seconds"],
                "base_version": ans.header["base_version"], "staleness": self.versions[p] - ans.header["base_version"], "weight": w,
            }  # fmt: skip
        clipped: dict[str, float] = {}
        if self.robust_clip is not None:
            outer_grads, scales = validation.clip_outliers(outer_grads, self.robust_clip)
            names = sorted(rnd.answers)
            clipped = {names[i]: f for i, f in scales.items()}
        merged, stats = merge_with_stats(
            outer_grads, weights, embedding_names=self.layout.embedding_names, method=d.merge
        )
        # Step copies: if persisting fails (store outage) the round stays open and is merged again later,
        # and the in-memory global model and momentum must not have moved.
        outer = OuterNesterov(lr=d.outer_lr, momentum=d.outer_momentum)
        outer.load_state_dict({n: t.clone() for n, t in self.outer[p].state_dict().items()})
        theta = {n: t.clone() for n, t in theta.items()}
        outer.step(theta, merged)
        version = self.versions[p] + 1
        rec = {
            "round": rnd.round, "fragment_id": p, "version": version, "opened_at": rnd.opened_wall,
            "time_to_quorum": (rnd.quorum_at or now) - rnd.opened_at, "grace_s": rnd.grace_s, "merged_at": self.wall(),
            "quorum": len(contributors), "contributors": contributors, "rejected": rnd.rejected,
            "merged_norm": stats["merged_norm"], "mean_delta_norm": stats["mean_delta_norm"], "ratio": stats["ratio"],
            "clipped": clipped,
        }  # fmt: skip
        published_at = self.wall()  # before the write: no learner can hold this version any earlier
        self.store.put(
            keys.momentum_key(p, version),
            wire.pack(
                outer.state_dict(),
                {"run_id": self.run_id, "kind": "momentum", "fragment_id": p, "version": version},
                key=self.key,
            ),
        )
        self.store.put_json(keys.round_record_key(rnd.round), rec)
        published = publish_global(
            self.store, self.run_id, p, version, theta, d.global_dtype, {"round": rnd.round}, key=self.key
        )
        self.published_at[(p, version)] = published_at
        self.merged_clock[p] = self.clock()
        self.published_at.pop((p, version - 64), None)
        self.bytes_published += published
        self.metrics.published.inc(published)
        if d.global_dtype == "bf16":  # learners see the rounded values; keep the syncer's copy identical
            for n in theta:
                theta[n].copy_(theta[n].to(torch.bfloat16).float())
        self.globals[p], self.outer[p], self.versions[p] = theta, outer, version
        self.recent[p][version] = {n: t.clone() for n, t in theta.items()}
        for v in sorted(self.recent[p])[:-KEEP_VERSIONS]:
            del self.recent[p][v]
        self._account(rec)
        for c, f in clipped.items():
            log.warning(
                "syncer: round %d: outer gradient of %s clipped by %.3g (robust mode)", rnd.round, c, f
            )
            self.clipped["norm_outlier"] += 1
            self.metrics.clipped.labels(reason="norm_outlier").inc()
        del self.open[rnd.round]
        self.xi_sync = self._ema(self.xi_sync, self.clock() - now)
        m = self.metrics
        m.rounds.labels(outcome="merged").inc()
        m.merges.labels(fragment=str(p)).inc()
        m.quorum.observe(len(contributors))
        m.grace.observe(rnd.grace_s)
        m.time_to_quorum.observe(rec["time_to_quorum"])
        m.merge_seconds.observe(self.clock() - now)
        for c in contributors.values():
            m.staleness.observe(c["staleness"])
        m.outer_grad_norm.labels(fragment=str(p)).set(stats["merged_norm"])
        self.publish_status()
        self._save_state()
        self.store.delete_prefix(keys.update_prefix(p, rnd.round))
        self._sweep_late(p)
        log.debug(
            "syncer: round %d fragment %d -> v%d from %d answers", rnd.round, p, version, len(contributors)
        )

    # --- the loop ---------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One pass of the loop; returns True when the run is finished."""
        now = self.clock()
        if now >= self._next_refresh:
            self.refresh_learners()
            # Until a learner reported its cadence, rounds are paced by a guess: look again soon.
            every = min(0.5, self.cfg.train.heartbeat_every_s) if self._measured_step() is not None else 0.05
            self._next_refresh = now + every
        if self.tokens_merged() >= self.cfg.diloco.token_budget:
            self.finish()
            return True
        self.maybe_open_round(now)
        for rnd in list(self.open.values()):
            self.progress(rnd, self.clock())
        return False

    def run(self, max_seconds: float | None = None) -> None:
        if self.store.exists(keys.DONE):
            log.info("syncer: run %s is already done", self.run_id)
            return
        self.publish_status()
        self._save_state()
        deadline = None if max_seconds is None else self.clock() + max_seconds
        last_log = self.clock()
        while True:
            try:
                if self.step():
                    return
            except StoreError as e:  # unreachable store: nothing half-merged was published; try again
                log.warning("syncer: store error (%s); retrying", e)
                time.sleep(1.0)
            if deadline is not None and self.clock() > deadline:
                log.warning(
                    "syncer: stopping after max_seconds=%s without reaching the token budget", max_seconds
                )
                return
            if self.clock() - last_log > 10:
                last_log = self.clock()
                log.info(
                    "syncer: %d/%d tokens merged, %d rounds, %d live learners",
                    self.tokens_merged(),
                    self.cfg.diloco.token_budget,
                    self.rounds_merged,
                    len(self.live_learners()),
                )
            time.sleep(self.poll_s)

    def finish(self) -> None:
        for rnd in list(self.open.values()):
            self.store.delete_prefix(keys.update_prefix(rnd.fragment_id, rnd.round))
        self.open.clear()
        self.store.delete_prefix("updates/")
        final = {n: t for g in self.globals for n, t in g.items()}
        self.store.put(
            keys.FINAL_MODEL,
            wire.pack(
                final, {"run_id": self.run_id, "kind": "final", "versions": self.versions}, key=self.key
            ),
        )
        self.store.put_json(
            keys.FINAL_META,
            {"versions": self.versions, "model": self.layout.model, "tokens_merged": self.tokens_merged()},
        )
        self._save_state()
        self.store.put_json(
            keys.DONE,
            {"time": self.wall(), "tokens_merged": self.tokens_merged(), "rounds_merged": self.rounds_merged},
        )
        self.publish_status(done=True)
        log.info(
            "syncer: done — %d tokens merged in %d rounds; versions %s",
            self.tokens_merged(),
            self.rounds_merged,
            self.versions,
        )
