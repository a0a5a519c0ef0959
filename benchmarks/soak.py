"""Soak: a local run under a seeded mix of faults at ≥ 100 per hour, next to a fault-free run of the same config.

Faults (real processes, real signals; `ddiloco.chaos` fires the scheduled ones, this script the two it has
no event kind for):
- learner SIGKILLs and learner stalls (SIGSTOP for 2–10 s), spread over the learners;
- syncer SIGKILLs (the launcher restarts it; the restarted syncer waits out or takes over the lease);
- a second syncer started by hand mid-run (`ddiloco syncer` against the same run: it stands by for the lease,
  and competes with the restarted first one after the next syncer kill);
- store outages of 5–20 s (every process refuses store calls);
- a learner added mid-run (`add_learner`) and, later, removed (SIGTERM, not restarted: a scale-down).

Times are drawn from a seeded RNG over `--minutes` (exponential gaps at `--rate` faults per hour, at least
100); the run ends at the token budget (`--tokens`, chosen so the run outlasts the schedule), and the
fault-free run gets the same config and budget and runs at the same time (side by side: both share the
machine's load; `--one-after-the-other` to run them in turn). Prints one JSON object last: faults fired by kind, tokens
processed / merged / discarded, `ledger_balanced`, versions contiguous, versions written by more than one
lease epoch (must be 0), final validation loss and goodput of both runs, and the mean time from a learner
kill to that learner's next merged answer.

    .venv/bin/python benchmarks/soak.py --minutes 20 --rate 120 --tokens 60000000 [--seed 0] [--set k=v ...]
"""

from __future__ import annotations

import argparse
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
from ddiloco.launch import LocalRun
from ddiloco.recipes import load_config
from ddiloco.store.url import open_store

log = logging.getLogger("soak")
LEARNERS = 4
ADDED = LEARNERS  # the id of the learner added mid-run


def schedule(minutes: float, rate: float, seed: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Chaos events (the kinds `ddiloco.chaos` fires) and this script's own actions, seeded."""
    rng = random.Random(seed)
    span, t, events = minutes * 60.0, 20.0, []
    kinds = ["kill_learner"] * 5 + ["stall_learner"] * 3 + ["kill_syncer", "store_outage"]
    while True:
        t += rng.expovariate(rate / 3600.0)
        if t > span:
            break
        kind = rng.choice(kinds)
        ev: dict[str, Any] = {"kind": kind, "at_s": round(t, 1)}
        if kind in ("kill_learner", "stall_learner"):
            ev["learner"] = rng.randrange(LEARNERS)
        if kind == "stall_learner":
            ev["duration_s"] = round(rng.uniform(2.0, 10.0), 1)
        if kind == "store_outage":
            ev["duration_s"] = round(rng.uniform(5.0, 20.0), 1)
        events.append(ev)
    events.append({"kind": "add_learner", "learner": ADDED, "at_s": round(span * 0.3, 1)})
    own = {"second_syncer_at_s": round(span * 0.45, 1), "remove_added_at_s": round(span * 0.7, 1)}
    return events, own


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


class OwnFaults(threading.Thread):
    """The faults `ddiloco.chaos` has no kind for: a second syncer started by hand, the added learner
    removed. Runs beside `LocalRun.run`, records what it did."""

    def __init__(self, run: LocalRun, own: dict[str, float]) -> None:
        super().__init__(daemon=True)
        self.run_, self.own, self.done = run, own, threading.Event()
        self.fired: list[dict[str, Any]] = []
        self.second: subprocess.Popen | None = None

    def run(self) -> None:
        todo = sorted((t, name) for name, t in self.own.items())
        for at, name in todo:
            while not self.done.wait(0.5):
                if time.time() - self.run_.t0 >= at:
                    break
            if self.done.is_set():
                return
            if name == "second_syncer_at_s":
                argv = [sys.executable, "-m", "ddiloco.cli", "syncer", "--store", self.run_.url]
                logs = self.run_.logdir / "syncer-second.log"
                with open(logs, "ab") as out:
                    env = {**os.environ, **self.run_.extra_env}
                    self.second = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
                self.fired.append({"kind": "second_syncer", "at_s": at, "pid": self.second.pid})
            elif name == "remove_added_at_s":
                proc = self.run_.find("learner", ADDED)
                if proc is not None and proc.popen is not None and proc.popen.poll() is None:
                    self.run_.procs.remove(proc)  # no longer supervised: not restarted
                    proc.popen.send_signal(signal.SIGTERM)
                    proc.popen.wait(timeout=60)
                    self.fired.append({"kind": "remove_learner", "at_s": at, "learner": ADDED})

    def stop(self) -> None:
        self.done.set()
        if self.second is not None and self.second.poll() is None:
            try:  # a standby exits by itself once the run is done
                self.second.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.second.kill()
                self.second.wait()


def kill_to_merged_answer(store, summary: dict[str, Any]) -> float | None:
    """Mean seconds from each learner SIGKILL to that learner's next merged answer (round record)."""
    merged: dict[str, list[float]] = {}
    for key in store.list(keys.ROUNDS):
        rec = store.get_json(key)
        for c in rec["contributors"]:
            merged.setdefault(c.split("-")[0], []).append(rec["merged_at"])
    gaps = []
    for ev in summary.get("chaos_events", []):
        if ev.get("kind") == "kill_learner" and str(ev.get("action", "")).startswith("SIGKILL"):
            later = [t for t in merged.get(str(ev["learner"]), []) if t > ev["fired_at"]]
            if later:
                gaps.append(min(later) - ev["fired_at"])
    return sum(gaps) / len(gaps) if gaps else None


def one_run(name: str, cfg, own: dict[str, float] | None, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        run = LocalRun(cfg, tmp, metrics_base_port=-1)
        faults = OwnFaults(run, own) if own else None
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
            ev["kind"] for ev in s.get("chaos_events", []) if not str(ev.get("action", "")).startswith("skip")
        )
        if faults is not None:
            fired.update(ev["kind"] for ev in faults.fired)
        out = {
            "run": name,
            "wall_seconds": round(wall, 1),
            "faults_by_kind": dict(fired),
            "faults": sum(fired.values()),
            "faults_per_hour": round(sum(fired.values()) / wall * 3600, 1),
            "tokens_processed": s["tokens_processed"],
            "tokens_merged": s["tokens_merged"],
            "tokens_discarded": s["tokens_discarded"],
            "tokens_outstanding": s.get("tokens_outstanding"),
            "ledger_balanced": s["ledger_balanced"],
            "versions_contiguous": s["global_versions_contiguous"],
            "versions_by_multiple_epochs": s.get("versions_by_multiple_epochs"),
            "syncer_epochs": s.get("syncer_epochs"),
            "incarnations": s["incarnations"],
            "final_val_loss": s["final_val_loss"],
            "goodput": s["goodput"],
            "mean_kill_to_merged_answer_s": kill_to_merged_answer(store, s),
        }
        log.info("%s: %s", name, json.dumps(out))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="span of the fault schedule")
    ap.add_argument("--rate", type=float, default=120.0, help="faults per hour (at least 100)")
    ap.add_argument("--tokens", type=int, default=60_000_000, help="token budget of both runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument(
        "--one-after-the-other", action="store_true", help="run the two runs in turn (default: side by side)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.rate < 100:
        raise SystemExit("--rate must be at least 100 faults per hour")
    events, own = schedule(args.minutes, args.rate, args.seed)
    log.info("schedule: %d chaos events and %s over %.0f minutes", len(events), own, args.minutes)
    timeout = args.minutes * 60 * 6 + 1800
    jobs = {
        "faults": lambda: one_run(
            "faults", config(args.tokens, events, args.set, "soak-faults"), own, timeout
        ),
        "fault_free": lambda: one_run(
            "fault-free", config(args.tokens, None, args.set, "soak-clean"), None, timeout
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
    print(json.dumps(result))


if __name__ == "__main__":
    main()
