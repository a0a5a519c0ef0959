"""Which GPUs each learner of a local run sees (`ddiloco run` on a machine with several GPUs).

A local run starts M learners of R ranks each on one host; left alone, every process would take GPU 0. The
launcher gives learner i the GPUs i·R … i·R+R−1 of those it sees, through `CUDA_VISIBLE_DEVICES` in its
environment, as a cluster gives each learner pod GPUs of its own. With more learners than GPUs the
assignment wraps around and learners share GPUs (the log says which has which); a learner's ranks never
share one, so R above the GPUs seen is a configuration error, reported before anything starts. The GPUs seen
are the launcher's own `CUDA_VISIBLE_DEVICES` when set, else those `torch.cuda.device_count()` finds. With
`train.device: cpu`, or no GPU seen, nothing is set and learners train on the CPU.

Design notes: docs/internals.md, "GPUs of a local run".
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from ddiloco.errors import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "CUDA_VISIBLE_DEVICES"


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs a process started with `env` may use, as `CUDA_VISIBLE_DEVICES` entries; none on a machine
    without a CUDA device, whatever the variable says."""
    import torch

    count = torch.cuda.device_count()
    spec = env.get(ENV_VAR)
    if count == 0 or spec is None:
        return [str(i) for i in range(count)]
    seen: list[str] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry or entry.startswith("-"):  # CUDA stops at the first invalid entry ("-1": none)
            break
        seen.append(entry)
    return seen


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """The GPUs of every learner of a local run (module docstring)."""

    gpus: tuple[str, ...]
    """The GPUs seen; empty: learners get no `CUDA_VISIBLE_DEVICES` of their own."""
    ranks: int
    """Ranks per learner (`train.ranks`)."""

    @classmethod
    def for_run(cls, device: str, learners: int, ranks: int, env: Mapping[str, str]) -> GpuPlan:
        """The plan for `train.device`, `diloco.learners` and `train.ranks` on this host (`env`: the
        launcher's environment); `ConfigError` when a learner's ranks would share a GPU."""
        gpus = () if device == "cpu" else tuple(visible_gpus(env))
        if device == "cuda" and not gpus:
            raise ConfigError(
                "train.device=cuda but no GPU is visible to this run (CUDA_VISIBLE_DEVICES or the driver); "
                "use train.device=auto or cpu"
            )
        if gpus and ranks > len(gpus):
            raise ConfigError(
                f"train.ranks={ranks} needs {ranks} GPUs per learner (NCCL takes one GPU per rank) but this "
                f"machine shows {len(gpus)}; lower train.ranks or set train.device=cpu (gloo)"
            )
        plan = cls(gpus, ranks)
        if gpus:
            shared = learners * ranks > len(gpus)
            log.info(
                "learners' GPUs: %s%s",
                ", ".join(f"{i}: {plan.of(i)}" for i in range(learners)),
                f" ({learners * ranks} learner ranks on {len(gpus)} GPUs: learners share GPUs)"
                if shared
                else "",
            )
        return plan

    def of(self, learner_id: int) -> str | None:
        """`CUDA_VISIBLE_DEVICES` for learner `learner_id` (any id: one added mid-run too), or None."""
        if not self.gpus:
            return None
        n, first = len(self.gpus), learner_id * self.ranks
        return ",".join(self.gpus[(first + r) % n] for r in range(self.ranks))

    def env(self, learner_id: int | None) -> dict[str, str]:
        """What to add to a process's environment: the learner's GPUs; nothing for the syncer."""
        gpus = None if learner_id is None else self.of(learner_id)
        return {} if gpus is None else {ENV_VAR: gpus}
