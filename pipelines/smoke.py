"""The `smoke` pipeline: the same steps as `pretrain` on CPU nodes only, with a tiny model and budget.

For clusters without GPUs, and as the first run after installing: it checks images, the store Secret, the
chaos and keeper RBAC and (with a chaos schedule) the Argo retry setting in a few minutes.
"""

from __future__ import annotations

from ddiloco.pipelines.pretrain import ClusterOptions

TINY = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "model.seq_len=64",
    "train.batch_size=8",
    "data.synthetic_docs=4000",
    "data.synthetic_entities=16",
    "diloco.fragments=2",
    "eval.val_batches=4",
    "train.device=cpu",
    "train.threads=2",
]

OPTIONS = ClusterOptions(
    name="ddiloco-smoke",
    description="ddiloco on CPU nodes only: a tiny model, 2 learners, a small token budget (minutes).",
    gpu=False,
    max_learners=4,
    learner_cpu="2",
    learner_memory="2Gi",
    syncer_cpu="1",
    syncer_memory="2Gi",
    learner_retries=20,
    syncer_retries=10,
    run_timeout_s=2 * 3600,
    defaults={
        "recipe": "tiny-cpu",
        "overrides": TINY,
        "learners": 2,
        "token_budget": 400_000,
        "gpu_node_selector": {},
        "gpu_tolerations": [],
    },
)
