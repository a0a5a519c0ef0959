"""`ddiloco run`: the local orchestrator. Same roles and store protocol as the cluster; only who starts the
processes (here: this module, with a restart policy like an Argo retry) and the store URL differ.

Design choices:
- Every role is a real OS process (`python -m ddiloco.cli learner|syncer`), so killing one is a real kill.
- The orchestrator only watches: it reads the syncer's status object for progress and restarts processes
  that die (delay with exponential backoff, a cap on restarts), and it never touches training state.
- Logs of each process go to `{workdir}/{run_id}.logs/`, outside the store prefix.
- On a machine with GPUs each learner gets its own (`CUDA_VISIBLE_DEVICES`, `ddiloco.platform.gpus`), as a learner pod
  does on a cluster.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco import keys
from ddiloco.chaos.local import LaunchedProcesses
from ddiloco.chaos.runner import ChaosRunner
from ddiloco.config.chaos_schedule import schedule_from_config
from ddiloco.config.run import RunConfig
from ddiloco.platform.gpus import GpuPlan
from ddiloco.platform.ports import free_port
from ddiloco.posttrain.evaluate import run_validation_loss
from ddiloco.posttrain.report import write_reports
from ddiloco.posttrain.stages import posttrain
from ddiloco.posttrain.summary import build_summary
from ddiloco.posttrain.tracked import posttrain_tracker
from ddiloco.protocol import signing
from ddiloco.protocol.messages import Status
from ddiloco.protocol.summary import Summary
from ddiloco.run.globalmodel import build_model
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot, prepared_at_of
from ddiloco.store.base import Store, StoreError
from ddiloco.store.url import open_store
from ddiloco.tracking.progress import Progress

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Proc:
    role: str
    learner_id: int | None
    popen: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


class LocalRun:
    def __init__(
        self,
        cfg: RunConfig,
        workdir: str | Path,
        *,
        store_root: str | None = None,
        extra_env: dict[str, str] | None = None,
        metrics_base_port: int | None = 0,
    ) -> None:
        """`store_root` (e.g. s3://bucket/runs) holds the run prefix; default a file:// store in workdir."""
        if not cfg.run_id:
            cfg.run_id = new_run_id()
        self.cfg = cfg
        base = store_root.rstrip("/") if store_root else f"file://{Path(workdir).resolve()}"
        self.url = f"{base}/{cfg.run_id}"
        self.logdir = Path(workdir).resolve() / f"{cfg.run_id}.logs"
        self.extra_env = dict(extra_env or {})
        self.gpus = (
            GpuPlan.for_run(  # each learner's GPUs (`ddiloco.platform.gpus`), before anything is written
                cfg.train.device, cfg.diloco.learners, cfg.train.ranks, {**os.environ, **self.extra_env}
            )
        )
        # The run key signs every update and global version; it never goes into the store. Without one
        # given, a key is generated once per run id and kept next to the logs (mode 0600).
        given = self.extra_env.get(signing.ENV_VAR) or os.environ.get(signing.ENV_VAR, "")
        if not given.strip():
            given = signing.ensure_key_file(Path(workdir).resolve() / f"{cfg.run_id}.key")
        self.secret = signing.parse_key(given)
        self.extra_env[signing.ENV_VAR] = given.strip()
        self.store: Store = open_store(self.url, env={**os.environ, **self.extra_env})
        self.root = RunRoot.keyed(self.store, cfg.run_id, self.secret, role="launcher")
        self.policy = cfg.restart
        self.chaos: ChaosRunner | None = None
        self.metrics_base_port = metrics_base_port
        self.metrics_ports: dict[str, int] = {}
        self.procs: list[Proc] = []
        self.restart_log: list[dict[str, Any]] = []
        self.t0 = time.time()

    # --- processes ------------------------------------------------------------------------------------------
    def _argv(self, proc: Proc) -> list[str]:
        argv = [sys.executable, "-m", "ddiloco.cli", proc.role, "--store", self.url]
        if proc.learner_id is not None:
            argv += ["--learner-id", str(proc.learner_id)]
            if (
                self.cfg.train.ranks > 1
            ):  # its ranks on this host, dying with it (`ddiloco.learner.localranks`)
                argv += ["--local-ranks", str(self.cfg.train.ranks)]
        port = self._metrics_port(proc)
        if port is not None:
            argv += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        return argv

    def _metrics_port(self, proc: Proc) -> int | None:
        """Each process keeps its port across restarts, so a scraper's targets stay valid."""
        if self.metrics_base_port is None or self.metrics_base_port < 0:
            return None
        name = proc.role if proc.learner_id is None else f"learner-{proc.learner_id}"
        if name not in self.metrics_ports:
            if self.metrics_base_port == 0:
                self.metrics_ports[name] = free_port()
            else:
                offset = 0 if proc.learner_id is None else 1 + proc.learner_id
                self.metrics_ports[name] = self.metrics_base_port + offset
            log.info("metrics of %s: http://127.0.0.1:%d/metrics", name, self.metrics_ports[name])
        return self.metrics_ports[name]

    def spawn(self, proc: Proc) -> None:
        self.logdir.mkdir(parents=True, exist_ok=True)
        name = proc.role if proc.learner_id is None else f"learner-{proc.learner_id}"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self.cfg.train.threads),
            **self.extra_env,
            **self.gpus.env(proc.learner_id),
        }
        if proc.role == "learner":  # a learner holds its share of the key, never the master key
            env.pop(signing.ENV_VAR, None)
            env.update(signing.learner_env(self.secret))
        with open(self.logdir / f"{name}.log", "ab") as out:
            proc.popen = subprocess.Popen(
                self._argv(proc), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        proc.restart_at = None
        log.debug("started %s (pid %d)", name, proc.popen.pid)

    def find(self, role: str, learner_id: int | None = None) -> Proc | None:
        for proc in self.procs:
            if proc.role == role and proc.learner_id == learner_id:
                return proc
        return None

    def add_learner(self, learner_id: int) -> Proc:
        proc = Proc("learner", learner_id)
        self.spawn(proc)
        self.procs.append(proc)
        return proc

    def supervise(self, now: float, done: bool) -> None:
        """Restart processes that died (non-zero exit) unless the run is done; like Argo's retry policy."""
        for proc in self.procs:
            if proc.popen is not None and proc.popen.poll() is not None:
                code = proc.popen.returncode
                proc.exit_codes.append(code)
                proc.popen = None
                if code != 0 and not done:
                    if proc.restarts >= self.policy.max_restarts:
                        log.error(
                            "%s %s exited with %d and has no restarts left", proc.role, proc.learner_id, code
                        )
                        continue
                    delay = min(
                        self.policy.delay_s * self.policy.factor**proc.restarts, self.policy.max_delay_s
                    )
                    proc.restart_at = now + delay
                    log.warning(
                        "%s %s exited with %d; restarting in %.1fs",
                        proc.role,
                        proc.learner_id if proc.learner_id is not None else "",
                        code,
                        delay,
                    )
            if proc.popen is None and proc.restart_at is not None and now >= proc.restart_at and not done:
                proc.restarts += 1
                self.restart_log.append(
                    {
                        "time_s": time.time() - self.t0,
                        "wall_time": time.time(),
                        "role": proc.role,
                        "learner_id": proc.learner_id,
                        "restart": proc.restarts,
                    }
                )
                self.spawn(proc)

    def running(self) -> list[Proc]:
        return [p for p in self.procs if p.popen is not None and p.popen.poll() is None]

    def stop_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.2)
        for proc in self.running():
            log.warning("%s %s did not exit after done; terminating", proc.role, proc.learner_id)
            proc.popen.kill()
            proc.popen.wait()

    # --- the run --------------------------------------------------------------------------------------------
    def evaluate_model(self, model) -> float:
        return run_validation_loss(model, self.root.val(), self.cfg)

    def run(
        self, on_progress: Callable[[Progress], None] | None = None, timeout: float | None = None
    ) -> Summary:
        cfg = self.cfg
        meta = prepare(self.store, cfg, secret=self.secret)
        layout = self.root.layout()
        log.info("run %s: starting syncer and %d learners", cfg.run_id, cfg.diloco.learners)
        self.chaos = ChaosRunner(
            self.store,
            LaunchedProcesses(self),
            schedule_from_config(cfg.chaos, cfg.diloco.learners),
            prepared_at_of(meta) or time.time(),
        )
        self.t0 = self.chaos.t0
        self.procs.append(Proc("syncer", None))
        self.spawn(self.procs[0])
        for i in range(cfg.diloco.learners):
            self.add_learner(i)
        deadline = None if timeout is None else time.monotonic() + timeout
        status: Status | None = None
        try:
            while True:
                self.chaos.poll()
                done = self._done()
                self.supervise(time.monotonic(), done)
                status = self._status() or status
                if on_progress is not None:
                    on_progress(Progress(status, time.time() - self.t0, len(self.running())))
                if done:
                    break
                if not self.running() and not any(p.restart_at for p in self.procs):
                    raise RuntimeError(
                        f"every process exited before the run finished; see the logs in {self.logdir}"
                    )
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"run did not finish within {timeout}s; see the logs in {self.logdir}")
                time.sleep(0.2)
            self.chaos.release()
            self.stop_all(timeout=60)
            # Answers uploaded while the syncer was finishing are garbage once every process is gone.
            self.store.delete_prefix(keys.UPDATES)
        finally:
            self.chaos.release()
            for proc in self.running():
                proc.popen.kill()
            self.root.write_launcher_events(
                {"restarts": self.restart_log, "chaos_events": [r.to_json() for r in self.chaos.records]}
            )
        # Evaluated afterwards so that chaos times (counted from the end of prepare) hit running processes.
        initial = self.evaluate_model(build_model(layout, cfg.seed))
        with posttrain_tracker(self.store, cfg) as tracker:
            tracker.scalar("eval/initial/val_loss", initial, 0)
            fields = posttrain(
                self.root, eval_cfg=cfg.eval, sft_cfg=cfg.sft, skip_sft=cfg.sft is None, tracker=tracker
            )
        summary = build_summary(self.store, {"initial_val_loss": initial, **fields})
        self.root.write_summary(summary)
        write_reports(self.store, curve_points=cfg.eval.curve_points)  # after summary.json, which it renders
        return summary

    def _done(self) -> bool:
        try:
            return self.root.is_done()
        except StoreError as e:  # the orchestrator only watches: a store hiccup is not a reason to stop
            log.warning("store unavailable to the orchestrator (%s)", e)
            return False

    def _status(self) -> Status | None:
        try:
            return self.root.status()
        except StoreError:
            return None
        except ValueError as e:  # the orchestrator only watches: an unreadable status shows no progress
            log.warning("unreadable syncer status (%s)", e)
            return None

    @property
    def summary_location(self) -> str:
        """Where summary.json is: a local path for file:// runs, else its URL."""
        url = f"{self.url}/{keys.SUMMARY}"
        return url[len("file://") :] if url.startswith("file://") else url
