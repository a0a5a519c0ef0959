"""The `join` pipeline: N learners of this cluster join a run another cluster owns (cross-region training).

Run it on a second Kubeflow install (another region, another cloud) while the owner's `pretrain` run is
training: every exchange goes through the object store, so a learner only needs the run's bucket. One CPU
step checks that the run root holds a prepared run and returns the slots; a ParallelFor starts one
`ddiloco learner --join RUN_ROOT --site SITE` per slot, placed and retried like the owner's learners. Each
learner claims a free learner id above the owner's (ddiloco/run/join.py) under a join name an Argo retry
takes back. `site` labels reports and metrics; `link_bandwidth` / `link_latency` emulate a slower link.

Design notes (Secrets, keys, images): docs/internals.md, "The join pipeline".
"""

import functools
from collections.abc import Callable
from typing import Any

from ddiloco.components import params
from ddiloco.components.roles import build
from ddiloco.pipelines.pretrain import ClusterOptions, _Wiring, run_defaults, task
from kfp import dsl

OPTIONS = ClusterOptions(
    name="ddiloco-join",
    description="Learners of this cluster join a ddiloco run owned by another cluster (cross-region training).",
)


def pipeline_function(opts: ClusterOptions = OPTIONS) -> Callable[..., Any]:
    """The `@dsl.pipeline` function of the join pipeline for these options: one parameter per row of
    `ddiloco.components.params.JOIN`, each passed by name to the steps its row names."""
    table = params.JOIN
    d = run_defaults(table, opts)
    c = build(opts.registry, gpu=opts.gpu)

    def join(p: dict[str, Any]) -> None:
        step = functools.partial(task, c, table, p)
        placement = p["gpu_node_selector"], p["gpu_tolerations"], p["cpu_node_selector"]
        k8s = _Wiring(opts, p["store_secret"], *placement)
        check = k8s.cpu_step(step("join_check", max_learners=opts.max_learners), "check-run")
        with dsl.ParallelFor(items=check.output, parallelism=opts.max_learners, name="learners") as slot:
            learner = step(
                "joiner",
                run_tag=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                slot=slot,
                metrics_port=opts.metrics_port,
                restarts=opts.crash_restarts,
            )
            k8s.learner(learner.after(check))

    return dsl.pipeline(name=opts.name, description=opts.description)(
        params.pipeline_func("join", table, d, join)
    )
