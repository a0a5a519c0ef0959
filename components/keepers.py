"""The keeper components: the KFP tasks of the learners and the syncer when they run in worker pods of their own
(`ClusterOptions.keeper`). Named `learner` and `syncer` like the roles they keep, so the compiled tasks keep
their names; each body is one call into `ddiloco.components.keeper_loop.keep_role`."""


def learner(
    store: str,
    learner_id: int,
    worker: dict,
    run_id: str = "",
    s3_endpoint: str = "",
    metrics_port: int = -1,
    restarts: int = 0,
    store_secret: str = "",
    node_selector: dict = {},  # noqa: B006 (a KFP default, never mutated)
    tolerations: list = [],  # noqa: B006 (a KFP default, never mutated)
    kueue_queue: str = "",
    pod_settings: dict = {},  # noqa: B006 (a KFP default, never mutated)
):
    """Keep one learner running in a worker pod of its own (`ddiloco.components.keeper_loop`): a new
    incarnation when the cluster takes it away, up to `restarts` more after a crash; `worker["ranks"]` > 1
    starts that many ranks in the pod (one per GPU, `ddiloco learner --local-ranks`)."""
    from ddiloco.components.keeper_loop import keep_role
    from ddiloco.components.runtime import run_root

    keep_role(
        "learner",
        run_root(store, run_id),
        run_id,
        worker,
        learner_id=learner_id,
        flags={
            "metrics_port": None if metrics_port < 0 else metrics_port,
            "local_ranks": worker.get("ranks", 1) if worker.get("ranks", 1) > 1 else None,
        },
        s3_endpoint=s3_endpoint,
        store_secret=store_secret,
        node_selector=node_selector,
        tolerations=tolerations,
        crash_restarts=restarts,
        kueue_queue=kueue_queue,
        pod_settings=pod_settings,
    )


def syncer(
    store: str,
    worker: dict,
    run_id: str = "",
    s3_endpoint: str = "",
    metrics_port: int = -1,
    restarts: int = 0,
    store_secret: str = "",
    node_selector: dict = {},  # noqa: B006 (a KFP default, never mutated)
    kueue_queue: str = "",
    pod_settings: dict = {},  # noqa: B006 (a KFP default, never mutated)
):
    """Keep the syncer running in a worker pod of its own (see `learner`) until it merged the token budget
    and wrote the final model to the run root."""
    from ddiloco.components.keeper_loop import keep_role
    from ddiloco.components.runtime import run_root

    keep_role(
        "syncer",
        run_root(store, run_id),
        run_id,
        worker,
        flags={"metrics_port": None if metrics_port < 0 else metrics_port},
        s3_endpoint=s3_endpoint,
        store_secret=store_secret,
        node_selector=node_selector,
        crash_restarts=restarts,
        kueue_queue=kueue_queue,
        pod_settings=pod_settings,
    )
