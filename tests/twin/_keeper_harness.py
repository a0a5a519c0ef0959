"""A keeper (components/keeper_loop.py `Keeper`, the real loop and the real manifests) run in this process against
the twin's API stand-in, owned by a KFP task pod of a one-step pipeline: what the keeper's workers and a
multi-node learner's TrainJob meet in a cluster's namespace (tests/twin/admission.py, kueue.py), without a
whole pretrain run. Worker commands are tiny (`print`); the TrainJob's runs `torchrun -m platform` on two
nodes."""

# No `from __future__ import annotations`: kfp reads the components' annotations at definition time.
import logging
import threading
from functools import partial

from ddiloco.components import trainjob
from ddiloco.components.keeper import Slot, WorkerSpec
from ddiloco.components.keeper_loop import Keeper, KubePods, KubeTrainJobs
from ddiloco.components.podsettings import PodSettings
from kfp import dsl

WORKER = ["python3", "-c", "print('worker done', flush=True)"]
NODE = ["python3", "-m", "platform"]  # under torchrun: `torchrun -m platform` (trainjob_command)


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def hold():
    import time

    time.sleep(300)


@dsl.pipeline(name="owner")
def owner():
    hold().set_caching_options(False)


class KeeperThread:
    """`Keeper.run` on a daemon thread: `outcome` is "succeeded", "failed: ..." or None while it runs; `logs`
    holds the keeper's log lines."""

    def __init__(
        self, ex, run_id: str, *, trainjobs: bool = False, settings: PodSettings | None = None, note=None
    ):
        task = ex.record.task("hold").attempts[0]
        pods = KubePods(ex.cluster.namespace, host=ex.api.url)
        extra = {}
        if trainjobs:
            manifest = partial(trainjob.trainjob_manifest, nodes=2, procs_per_node=1)
            extra = {"workers": KubeTrainJobs(pods), "manifest": manifest}
        spec = WorkerSpec(image="img", command=NODE if trainjobs else WORKER, requests={"cpu": "100m"},
                          settings=settings or PodSettings())  # fmt: skip
        slot = Slot("learner", run_id, 0)
        self.keeper = Keeper(pods, slot, spec, task.pod_name, crash_restarts=0, infra_restarts=0,
                             backoff_s=0.0, poll_s=0.1, note=note, **extra)  # fmt: skip
        self.outcome: str | None = None
        self.logs: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        handler = _Lines(self.logs)
        logging.getLogger("ddiloco.keeper").addHandler(handler)
        logging.getLogger("ddiloco.keeper").setLevel(logging.INFO)
        try:
            self.keeper.run()
            self.outcome = "succeeded"
        except Exception as e:  # noqa: BLE001 (the test reads what happened)
            self.outcome = f"failed: {e}"
        finally:
            logging.getLogger("ddiloco.keeper").removeHandler(handler)

    def start(self) -> "KeeperThread":
        self._thread.start()
        return self

    def wait(self, timeout_s: float) -> str | None:
        """The outcome, or None if the keeper still watches after `timeout_s` (a worker stuck Running)."""
        self._thread.join(timeout_s)
        return self.outcome


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
