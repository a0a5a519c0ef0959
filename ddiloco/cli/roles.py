"""The roles a run is made of, as commands: `prepare`, `learner`, `syncer` and `summary`.

`ddiloco run` starts the learner and syncer roles as processes (`python -m ddiloco.cli learner|syncer`), the
Kubeflow components start every role the same way. A role started during a store outage waits for the
store (pods start in any order); a role on a run root that holds no run fails at once. `ddiloco syncer`
takes the run's lease before it resumes, stands by while another syncer holds it, exits with `FENCED_EXIT`
(3) when fenced and releases the lease when it ends. A learner none of whose answers was merged for
`train.max_unmerged_s` exits with 4 (`ddiloco.learner.health`) to be restarted. torch-heavy modules are
imported inside the handlers, so the cheap commands start fast.

Design notes: docs/internals.md, "The command line".
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any, TypeVar

from ddiloco import keys
from ddiloco.cli.args import add_config_args, add_metrics_args, config_for_store, emit
from ddiloco.platform import failpoints
from ddiloco.protocol import signing
from ddiloco.run.join import add_learner_args, learner_id_for, resolve_args, shape_learner_store
from ddiloco.store.base import Store
from ddiloco.store.retry import until_store_answers
from ddiloco.store.url import open_store
from ddiloco.syncer.lease import FENCED_EXIT, Fenced, Lease
from ddiloco.tracking import logship
from ddiloco.tracking.metrics import push_task_metrics, serve
from ddiloco.tracking.tracker import OFF, open_tracker

log = logging.getLogger("ddiloco")
T = TypeVar("T")


def role_store(url: str, role: str) -> Store:
    """The role's store (with the run's chaos wrapper) once the store answers; a clear error (run `ddiloco
    prepare` first) when the run root holds no run."""
    from ddiloco.chaos.inprocess import chaos_store
    from ddiloco.run.root import RunRoot  # imports torch: only in the roles that train

    store = open_store(url)
    cfg = until_store_answers(lambda: RunRoot.read_config(store), role)
    return until_store_answers(lambda: chaos_store(store, cfg), role)


def cmd_prepare(args: argparse.Namespace) -> int:
    from ddiloco.run.prepare import prepare

    cfg = config_for_store(args)
    t0 = time.monotonic()
    meta = prepare(open_store(args.store), cfg, secret=signing.key_from_env())
    task_metrics = {
        "seconds": time.monotonic() - t0,
        "train_tokens": sum(meta["shard_tokens"]),
        "val_tokens": meta["val_tokens"],
    }
    push_task_metrics(args.pushgateway, "prepare", cfg.run_id, task_metrics)
    return emit(meta)


def cmd_learner(args: argparse.Namespace) -> int:
    from ddiloco.learner import ddp, localranks

    # Started by torchrun (or with --local-ranks N) with WORLD_SIZE > 1: rank 0 is the learner, the other
    # ranks follow it and never touch the store (`ddiloco.learner.ddp`).
    followers = localranks.start_followers(args.local_ranks)
    group = ddp.from_env(args.device or "auto")
    if group is not None and group.rank > 0:
        try:
            return ddp.Follower(group).run() or 0
        finally:
            group.close()
    try:
        return run_learner(args, group)
    finally:
        if group is not None:
            group.close()  # tells the followers to stop, even when rank 0 exits early
        localranks.reap(followers)


def _signed_done(store: Store, secret: Any) -> bool:
    """Whether the run's syncer marked it done (a marker it did not sign is logged and not believed)."""
    from ddiloco.run.root import RunRoot

    return store.exists(keys.DONE) and RunRoot.open(store, secret, role="learner").is_done()


def run_learner(args: argparse.Namespace, group: Any) -> int:
    """Rank 0's part of `ddiloco learner`: join the run (or take the given id) and train until it is done;
    `UNMERGED_EXIT` (4) when none of its answers was merged for the bound (`ddiloco.learner.health`)."""
    from ddiloco.learner.health import UNMERGED_EXIT, Unmerged
    from ddiloco.learner.loop import Learner

    secret = signing.key_from_env()
    url, site = resolve_args(args)  # --store URL --learner-id N, or --join URL [--learner-id N]
    wrapped = role_store(url, "learner")  # reads through the run's outage windows from here on
    store = until_store_answers(
        lambda: shape_learner_store(wrapped, args.link_bandwidth, args.link_latency), "learner"
    )
    if until_store_answers(lambda: _signed_done(store, secret), "learner"):
        log.info("run at %s is already done; learner %s exits", url, args.learner_id)
        return 0
    lid = until_store_answers(lambda: learner_id_for(store, args.learner_id, site, args.join_name), "learner")
    learner = until_store_answers(
        lambda: Learner.open(store, lid, device=args.device, secret=secret, site=site, group=group), "learner"
    )
    logship.bind(url, ident=lid, incarnation=learner.incarnation)
    serve(learner.registry, args.metrics_port, args.metrics_host)
    tracking, role = learner.cfg.tracking, f"learner-{lid}"
    learner.tracker = open_tracker(url, tracking, role, run_id=learner.run_id, registry=learner.registry)
    finished = False
    try:
        learner.run(max_steps=args.max_steps, wait_timeout=args.wait_timeout)
        finished = True
    except Unmerged as e:
        log.error("%s (exit %d)", e, UNMERGED_EXIT)
        return UNMERGED_EXIT
    finally:
        learner.tracker.close(finished=finished)
    return 0


def cmd_syncer(args: argparse.Namespace) -> int:
    from ddiloco.run.root import RunRoot

    failpoints.load_env()  # tests and the soak benchmark crash a syncer inside a publish
    secret = signing.key_from_env()
    store = role_store(args.store, "syncer")
    cfg = until_store_answers(lambda: RunRoot.read_config(store), "syncer")
    return run_syncer(store, Lease(store, cfg.run_id, cfg.lease), args, secret)


def run_syncer(store: Store, lease: Lease, args: argparse.Namespace, secret: bytes | None) -> int:
    """Stand by until `lease` is ours, resume and run the syncer; 0 when the run is done (also when it got
    done while standing by), `FENCED_EXIT` when another syncer took the lease over."""
    from ddiloco.run.root import RunRoot
    from ddiloco.syncer.loop import Syncer, run_until_done, syncer_threads

    done_root = RunRoot.keyed(store, lease.run_id, secret, role="syncer")
    if not lease.acquire(done=done_root.is_done):
        log.info("syncer: the run is done; this standby exits")
        return 0
    tracker, finished = OFF, False
    try:
        threads = getattr(args, "threads", None) or syncer_threads()
        syncer = until_store_answers(
            lambda: Syncer.open(store, secret=secret, lease=lease, threads=threads), "syncer"
        )
        logship.bind(args.store, incarnation=syncer.books.incarnation)
        serve(syncer.registry, args.metrics_port, args.metrics_host)
        tracker = syncer.tracker = open_tracker(
            args.store,
            syncer.cfg.tracking,
            "syncer",
            run_id=syncer.run_id,
            mlflow=True,
            registry=syncer.registry,
        )
        tracker.params(syncer.cfg.to_dict())
        run_until_done(syncer, args.max_seconds)
        finished = True
    except Fenced as e:
        log.error(
            "syncer epoch %d stopped publishing: %s. Another syncer of this run holds the lease now; this one "
            "exits with %d and wrote nothing after it found out. Nothing to do if that syncer is a retry or "
            "restart; otherwise look for two syncer pods of one run (a duplicated pipeline run or step).",
            lease.epoch,
            e,
            FENCED_EXIT,
        )
        return FENCED_EXIT
    finally:
        lease.release()  # a standby takes over at once instead of waiting the lease out
        tracker.close(finished=finished)
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    from ddiloco.posttrain.summary import build_summary

    return emit(build_summary(open_store(args.store)).to_json(), indent=2)


def register(sub: Any) -> None:
    """Add `prepare`, `learner`, `syncer` and `summary` to the `ddiloco` subcommands."""
    p = sub.add_parser(
        "prepare", help="write config, tokenizer, shards, validation split and global v0 to the store"
    )
    p.add_argument(
        "--store", required=True, help="run root: file:///dir/run, s3://bucket/prefix/run, memory://name"
    )
    p.add_argument(
        "--pushgateway",
        default=os.environ.get("DDILOCO_PUSHGATEWAY"),
        help="Pushgateway URL for task metrics",
    )
    add_config_args(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("learner", help="run one learner against a prepared run root")
    p.add_argument("--store", help="run root of this learner's run (or --join URL)")
    p.add_argument("--learner-id", type=int, help="learner id; a new id joins a running run (--join: picked)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--wait-timeout", type=float, default=None, help="seconds to wait for global version 0")
    p.add_argument(
        "--local-ranks",
        type=int,
        default=1,
        help="start this many ranks of the learner on this host (train.ranks; instead of torchrun: the ranks "
        "die with this process)",
    )
    add_metrics_args(p)
    add_learner_args(p)  # --join URL, --site, --join-name, --link-bandwidth, --link-latency
    p.set_defaults(func=cmd_learner)

    p = sub.add_parser(
        "syncer",
        help="run the syncer until the token budget is merged (a second one stands by for the lease; "
        f"exit {FENCED_EXIT}: another syncer took the lease over)",
    )
    p.add_argument("--store", required=True)
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads: half read, verify and measure answers ahead, the rest run the merge (default: "
        "OMP_NUM_THREADS if set, else the CPUs this process may use, at most 8)",
    )
    add_metrics_args(p)
    p.set_defaults(func=cmd_syncer)

    p = sub.add_parser("summary", help="print the run summary computed from the store")
    p.add_argument("--store", required=True)
    p.set_defaults(func=cmd_summary)
