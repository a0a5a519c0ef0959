"""Soak: a local run under a seeded mix of faults at ≥ 100 per hour, next to a fault-free run of the same config.

Faults (real processes, real signals; `ddiloco.chaos` fires the kinds it has, this script the others):
- learner SIGKILLs and learner stalls (SIGSTOP for 2–10 s), spread over the learners;
- syncer SIGKILLs (the launcher restarts it; the restarted syncer waits out or takes over the lease);
- preemptions of a learner or the syncer the way the kubelet ends a pod on spot preemption, graceful node
  shutdown, eviction or a drain: SIGTERM, a grace period (`GRACE_S`, Kubernetes' default is 30 s, scaled
  down here), then SIGKILL if the process is still alive;
- OOM-style kills: SIGKILL of the run's process with the largest resident set, the one the kernel's OOM
  killer picks in a cgroup (`oom_badness` is dominated by RSS); on a learner or on the syncer, as it falls;
- crashes inside a publish: every syncer is restarted with a one-shot failpoint (`ddiloco.platform.failpoints`) armed
  at a random write of a publish (after the momentum, the master, the round record, the download delta, the
  global version, the pointer, the status or the state), so whichever holds the lease next SIGKILLs itself
  there in one of its next publishes (the first to reach it; the marker makes it one-shot);
- a second syncer started by hand mid-run (`ddiloco syncer` against the same run: it stands by for the lease,
  and competes with the restarted first one after the next syncer kill). This script restarts it when it
  dies, as the launcher does the first. A preemption of "the syncer" hits the one that holds the lease (the
  newest claim's pid), so once the second one has taken over, syncer faults still reach the active syncer;
  `kill_syncer` (fired by `ddiloco.chaos`) kills the launcher's syncer, active or standing by;
- store outages of 5–20 s (every process refuses store calls);
- a learner added mid-run (`add_learner`) and, later, removed (SIGTERM, not restarted: a scale-down).

Times are drawn from a seeded RNG over `--minutes` (exponential gaps at `--rate` faults per hour, at least
100); the run ends at the token budget (`--tokens`, chosen so the run outlasts the schedule), and the
fault-free run gets the same config and budget and runs at the same time (side by side: both share the
machine's load; `--one-after-the-other` to run them in turn). Prints one JSON object last: faults fired by kind, tokens
processed / merged / discarded, `ledger_balanced`, versions contiguous, versions written by more than one
lease epoch (must be 0), final validation loss and goodput of both runs, and the mean time from a learner
kill to that learner's next merged answer, and the longest time the faulted run went without merging a round
(`longest_merge_gap_s`, beside the fault-free run's: a stuck syncer shows there).

    .venv/bin/python benchmarks/soak.py --minutes 20 --rate 240 --tokens 64000000 [--seed 0] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from ddiloco import keys
from ddiloco.config.recipes import load_config
from ddiloco.launch import LocalRun
from ddiloco.platform import failpoints
from ddiloco.protocol.summary import Summary
from ddiloco.store.url import open_store

log = logging.getLogger("soak")
LEARNERS = 4
ADDED = LEARNERS  # the id of the learner added mid-run


GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL in a preemption (the pod's terminationGracePeriodSeconds, scaled)."""
CHAOS_KINDS = ["kill_learner"] * 5 + ["stall_learner"] * 3 + ["kill_syncer", "store_outage"]
OWN_KINDS = ["preempt_learner"] * 2 + ["preempt_syncer", "oom_kill", "publish_crash"]
PUBLISH_STEPS = list(failpoints.STEPS["publish"])


def schedule(minutes: float, rate: float, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Chaos events (the kinds `ddiloco.chaos` fires) and this script's own faults, seeded: a fault is one
    of this script's kinds about one time in three."""
    rng = random.Random(seed)
    span, t, events, own = minutes * 60.0, 20.0, [], []
    while True:
        t += rng.expovariate(rate / 3600.0)
        if t > span:
            break
        kind = rng.choice(CHAOS_KINDS + OWN_KINDS)
        ev: dict[str, Any] = {"kind": kind, "at_s": round(t, 1)}
        if kind in ("kill_learner", "stall_learner", "preempt_learner"):
            ev["learner"] = rng.randrange(LEARNERS)
        if kind == "stall_learner":
            ev["duration_s"] = round(rng.uniform(2.0, 10.0), 1)
        if kind == "store_outage":
            ev["duration_s"] = round(rng.uniform(5.0, 20.0), 1)
        if kind == "publish_crash":
            ev["step"] = rng.choice(PUBLISH_STEPS)
            ev["nth"] = rng.randint(1, 3)  # which of the restarted syncer's publishes it dies in
        (own if kind in OWN_KINDS else events).append(ev)
    events.append({"kind": "add_learner", "learner": ADDED, "at_s": round(span * 0.3, 1)})
    own.append({"kind": "second_syncer", "at_s": round(span * 0.45, 1)})
    own.append({"kind": "remove_learner", "learner": ADDED, "at_s": round(span * 0.7, 1)})
    return events, sorted(own, key=lambda e: e["at_s"])


def config(tokens: int, events: list[dict[str, Any]] | None, extra: list[str], run_id: str):
    overrides = [
        f"diloco.learners={LEARNERS}",
        f"diloco.max_learners={ADDED + 1}",  # both runs cut the same shards (the added learner has its own)
        f"diloco.token_budget={tokens}",
        "restart.max_restarts=1000",
        "sft=null",
        *extra,
    ]
    if events is not None:
        overrides.append("chaos.events=" + json.dumps(events))
    cfg = load_config(None, None, overrides)
    cfg.run_id = run_id
    return cfg


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class OwnFaults(threading.Thread):
    """The faults `ddiloco.chaos` has no kind for (see the module docstring). Runs beside `LocalRun.run`,
    records what it did."""

    def __init__(self, run: LocalRun, own: list[dict[str, Any]], workdir: str) -> None:
        super().__init__(daemon=True)
        self.run_, self.own, self.workdir, self.done = run, own, workdir, threading.Event()
        self.fired: list[dict[str, Any]] = []
        self.armed: list[tuple[dict[str, Any], str]] = []
        self.second: subprocess.Popen | None = None
        self.second_exits: list[int] = []

    def _alive(self, role: str, learner: int | None = None) -> subprocess.Popen | None:
        proc = self.run_.find(role, learner)
        popen = proc.popen if proc is not None else None
        return popen if popen is not None and popen.poll() is None else None

    def _start_second(self) -> subprocess.Popen:
        """(Re)start the second syncer with the run's current environment (failpoints armed included)."""
        argv = [sys.executable, "-m", "ddiloco.cli", "syncer", "--store", self.run_.url]
        with open(self.run_.logdir / "syncer-second.log", "ab") as out:
            env = {**os.environ, **self.run_.extra_env}
            self.second = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self.second

    def _second_alive(self) -> subprocess.Popen | None:
        """The second syncer, restarted first if it died with a non-zero code (a standby that saw the run
        done exits 0 and stays down)."""
        if self.second is None:
            return None
        code = self.second.poll()
        if code is None:
            return self.second
        if code != 0 and not self.done.is_set():
            self.second_exits.append(code)
            log.info("second syncer exited with %d; restarting it", code)
            return self._start_second()
        return None

    def _active_syncer(self) -> subprocess.Popen | None:
        """The live syncer that holds the lease (the newest claim names its pid); the launcher's if none
        of the live ones matches (the lease is changing hands)."""
        live = [p for p in (self._alive("syncer"), self._second_alive()) if p is not None]
        pid = lease_holder_pid(self.run_.store)
        return next((p for p in live if p.pid == pid), live[0] if live else None)

    def run(self) -> None:
        for ev in self.own:
            while not self.done.wait(0.5):
                self._second_alive()  # supervised like the launcher's processes
                if time.time() - self.run_.t0 >= ev["at_s"]:
                    break
            if self.done.is_set():
                return
            try:
                outcome = self.fire(ev)
            except Exception:  # a fault that could not be fired is logged, the soak goes on
                log.exception("could not fire %s", ev)
                continue
            if outcome is not None:
                self.fired.append({**ev, **outcome})
                log.info("fired %s: %s", ev, outcome)
            else:
                log.info("skipped %s: no live target", ev)

    def fire(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        kind = ev["kind"]
        if kind == "second_syncer":
            return {"pid": self._start_second().pid}
        if kind == "remove_learner":
            proc = self.run_.find("learner", ADDED)
            if proc is None or self._alive("learner", ADDED) is None:
                return None
            self.run_.procs.remove(proc)  # no longer supervised: not restarted
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.wait(timeout=60)
            return {}
        if kind in ("preempt_learner", "preempt_syncer"):
            if kind == "preempt_learner":
                popen = self._alive("learner", ev["learner"])
            else:
                popen = self._active_syncer()
            if popen is None:
                return None
            which = {} if kind == "preempt_learner" else {"second": popen is self.second}
            popen.send_signal(signal.SIGTERM)
            try:
                popen.wait(timeout=GRACE_S)
                ended = "SIGTERM"
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
                ended = "SIGKILL after the grace period"
            if popen is self.second:
                self._second_alive()  # restarted like the launcher's (a SIGTERMed syncer exits non-zero)
            return {"pid": popen.pid, "ended_by": ended, **which}
        if kind == "oom_kill":
            live = [(p.role, p.learner_id, p.popen) for p in self.run_.running()]
            if (second := self._second_alive()) is not None:
                live.append(("syncer-second", None, second))
            if not live:
                return None
            role, learner, popen = max(live, key=lambda r: rss_kib(r[2].pid))
            rss = rss_kib(popen.pid)
            popen.kill()
            if popen is second:
                popen.wait()
                self._second_alive()
            return {"victim": role if learner is None else f"learner-{learner}", "rss_kib": rss}
        if kind == "publish_crash":
            first, second = self._alive("syncer"), self._second_alive()
            if first is None and second is None:
                return None
            marker = os.path.join(self.workdir, f"failpoint-{len(self.armed)}")
            # armed for every process started from now on; one-shot: it fires where it can create the marker
            self.run_.extra_env[failpoints.ENV_VAR] = f"publish:{ev['step']}:kill@{ev['nth']}"
            self.run_.extra_env[failpoints.ONCE_ENV_VAR] = marker
            self.armed.append((ev, marker))
            # Every syncer restarts armed, so the failpoint waits in whichever holds the lease next.
            if first is not None:
                first.kill()  # the launcher restarts it with the failpoint armed
            if second is not None:
                second.kill()
                second.wait()
                self._start_second()
            return {"marker": marker, "restarted": 1 + (second is not None)}
        raise ValueError(f"unknown own fault kind {kind!r}")

    def publish_crashes(self) -> int:
        """Publish crashes that really happened (the failpoint created its marker)."""
        return sum(os.path.exists(marker) for _, marker in self.armed)

    def stop(self) -> None:
        self.done.set()
        if self.second is not None and self.second.poll() is None:
            try:  # a standby exits by itself once the run is done
                self.second.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.second.kill()
                self.second.wait()


def lease_holder_pid(store) -> int | None:
    """The pid in the newest lease claim (`ddiloco.syncer.lease`): the syncer that holds or last held it."""
    try:
        epochs = [e for e in map(keys.lease_epoch_of, store.list(keys.lease_claim_prefix())) if e is not None]
        claim = store.get_json_or_none(keys.lease_claim_key(max(epochs))) if epochs else None
    except Exception:  # an injected store outage: no answer this time
        return None
    pid = claim.get("pid") if isinstance(claim, dict) else None
    return pid if isinstance(pid, int) else None


def longest_merge_gap(store) -> float | None:
    """The longest time between two merged rounds (seconds, on the syncer's clock)."""
    times = sorted(store.get_json(key)["merged_at"] for key in store.list(keys.ROUNDS))
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=None)


def kill_to_merged_answer(store, summary: Summary) -> float | None:
    """Mean seconds from each learner SIGKILL to that learner's next merged answer (round record)."""
    merged: dict[str, list[float]] = {}
    for key in store.list(keys.ROUNDS):
        rec = store.get_json(key)
        for c in rec["contributors"]:
            merged.setdefault(c.split("-")[0], []).append(rec["merged_at"])
    gaps = []
    for ev in summary.chaos_events:
        if ev.get("kind") == "kill_learner" and str(ev.get("action", "")).startswith("SIGKILL"):
            later = [t for t in merged.get(str(ev["learner"]), []) if t > ev["fired_at"]]
            if later:
                gaps.append(min(later) - ev["fired_at"])
    return sum(gaps) / len(gaps) if gaps else None


def one_run(
    name: str, cfg, own: list[dict[str, Any]] | None, timeout: float, keep: str | None = None
) -> dict[str, Any]:
    with contextlib.nullcontext(os.path.join(keep, name)) if keep else tempfile.TemporaryDirectory() as tmp:
        run = LocalRun(cfg, tmp, metrics_base_port=-1)
        faults = OwnFaults(run, own, tmp) if own else None
        if faults is not None:
            faults.start()
        start = time.monotonic()
        try:
            s = run.run(timeout=timeout)
        finally:
            if faults is not None:
                faults.stop()
        wall = time.monotonic() - start
        store = open_store(run.url)
        fired = Counter(
            ev["kind"] for ev in s.chaos_events if not str(ev.get("action", "")).startswith("skip")
        )
        if faults is not None:
            fired.update(ev["kind"] for ev in faults.fired)
        out = {
            "run": name,
            "wall_seconds": round(wall, 1),
            "faults_by_kind": dict(fired),
            "faults": sum(fired.values()),
            "faults_per_hour": round(sum(fired.values()) / wall * 3600, 1),
            "tokens_processed": s.tokens_processed,
            "tokens_merged": s.tokens_merged,
            "tokens_discarded": s.tokens_discarded,
            "tokens_outstanding": s.tokens_outstanding,
            "ledger_balanced": s.ledger_balanced,
            "versions_contiguous": s.global_versions_contiguous,
            "versions_by_multiple_epochs": s.versions_by_multiple_epochs,
            "syncer_epochs": s.syncer_epochs,
            "incarnations": s.incarnations,
            "final_val_loss": s.final_val_loss,
            "goodput": s.goodput,
            "mean_kill_to_merged_answer_s": kill_to_merged_answer(store, s),
            "longest_merge_gap_s": longest_merge_gap(store),
            "exit_codes": {
                p.role if p.learner_id is None else f"learner-{p.learner_id}": p.exit_codes for p in run.procs
            },
        }
        if faults is not None:
            out["publish_crashes_armed"] = len(faults.armed)
            out["publish_crashes_happened"] = faults.publish_crashes()
            out["exit_codes"]["syncer-second"] = faults.second_exits
        log.info("%s: %s", name, json.dumps(out))
        return out


KIND_NAMES = {  # singular, plural
    "kill_learner": ("learner SIGKILL", "learner SIGKILLs"),
    "oom_kill": ("OOM-style kill", "OOM-style kills"),
    "preempt_learner": ("learner preemption", "learner preemptions"),
    "stall_learner": ("learner stall", "learner stalls"),
    "store_outage": ("store outage", "store outages"),
    "kill_syncer": ("syncer SIGKILL", "syncer SIGKILLs"),
    "preempt_syncer": ("syncer preemption", "syncer preemptions"),
    "add_learner": ("learner added", "learners added"),
}


def headline_figures(result: dict) -> dict:
    """The figures docs/results/soak.json's headline names, from this script's result: the faulted run's own
    minutes (the budget may end it before the schedule), its faults by kind, tokens lost, loss and goodput."""
    faulty = result["faults"]
    kinds = sorted(faulty["faults_by_kind"].items(), key=lambda kv: (-kv[1], kv[0]))
    return {
        "minutes": round(faulty["wall_seconds"] / 60, 1),
        "faults": faulty["faults"],
        "faults_per_hour": round(faulty["faults_per_hour"]),
        "kinds": ", ".join(f"{n} {KIND_NAMES.get(k, (k, k))[n != 1]}" for k, n in kinds),
        "merged_tokens_lost": int(result["merged_tokens_lost"]),
        "loss_ratio": round(result["final_loss_ratio"], 3),
        "goodput": round(faulty["goodput"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="span of the fault schedule")
    ap.add_argument("--rate", type=float, default=240.0, help="faults per hour (at least 100)")
    ap.add_argument("--tokens", type=int, default=60_000_000, help="token budget of both runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", metavar="DIR", help="run in DIR/<run> and keep it (logs, store) afterwards")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument(
        "--one-after-the-other", action="store_true", help="run the two runs in turn (default: side by side)"
    )
    ap.add_argument(
        "--record", default=None, metavar="CLAIM", help="also write docs/results/CLAIM.json (_record.py)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.rate < 100:
        raise SystemExit("--rate must be at least 100 faults per hour")
    events, own = schedule(args.minutes, args.rate, args.seed)
    log.info(
        "schedule: %d chaos events and %d of this script's over %.0f minutes",
        len(events),
        len(own),
        args.minutes,
    )
    timeout = args.minutes * 60 * 6 + 1800
    jobs = {
        "faults": lambda: one_run(
            "faults", config(args.tokens, events, args.set, "soak-faults"), own, timeout, args.keep
        ),
        "fault_free": lambda: one_run(
            "fault-free", config(args.tokens, None, args.set, "soak-clean"), None, timeout, args.keep
        ),
    }
    results: dict[str, dict[str, Any]] = {}
    if args.one_after_the_other:
        results = {name: job() for name, job in jobs.items()}
    else:  # side by side: both runs share the machine's load, so their wall-clock figures compare
        threads = [
            threading.Thread(target=lambda n=n, j=j: results.update({n: j()})) for n, j in jobs.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if set(results) != set(jobs):
            raise SystemExit(f"a run failed: only {sorted(results)} finished (see the log above)")
    faulty, clean = results["faults"], results["fault_free"]
    result = {
        "minutes": args.minutes,
        "rate_per_hour": args.rate,
        "seed": args.seed,
        "tokens": args.tokens,
        "faults": faulty,
        "fault_free": clean,
        "merged_tokens_lost": faulty["tokens_processed"]
        - faulty["tokens_merged"]
        - faulty["tokens_discarded"]
        - (faulty["tokens_outstanding"] or 0),
        "final_loss_ratio": faulty["final_val_loss"] / clean["final_val_loss"],
    }
    if args.record:
        from _record import record

        record(args.record, headline_figures(result), result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
