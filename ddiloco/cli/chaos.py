"""`ddiloco chaos`: fire a run's timed chaos schedule at its learner and syncer pods (or local processes).

The role itself is `ddiloco.chaos.runner` over a backend (`chaos.k8s`, `chaos.local`); this module parses,
picks the backend and writes the Markdown table for the KFP UI.

Design choices:
- The schedule is read from the run root's config.json, so the pipeline's chaos step needs only `--store`.
- Kubernetes settings come from flags, else from the environment the pipeline sets
  (`DDILOCO_K8S_NAMESPACE`, `DDILOCO_K8S_WORKFLOW`), else from the pod's service account.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path
from typing import Any

from ddiloco import keys
from ddiloco.chaos.k8s import (
    DEFAULT_SELECTOR,
    SA_NAMESPACE_FILE,
    WORKFLOW_LABEL,
    ChaosBackendError,
    KubernetesPods,
)
from ddiloco.chaos.local import LocalPids
from ddiloco.chaos.record import markdown_table
from ddiloco.chaos.runner import Backend, ChaosRunner
from ddiloco.config.chaos_schedule import schedule_from_config
from ddiloco.config.run import RunConfig
from ddiloco.store.url import open_store

log = logging.getLogger(__name__)


def namespace(arg: str | None) -> str:
    """--namespace, else $DDILOCO_K8S_NAMESPACE, else the namespace of the pod this runs in."""
    ns = arg or os.environ.get("DDILOCO_K8S_NAMESPACE")
    if not ns and os.path.isfile(SA_NAMESPACE_FILE):
        ns = Path(SA_NAMESPACE_FILE).read_text().strip()
    if not ns:
        raise ChaosBackendError("no namespace: pass --namespace or set DDILOCO_K8S_NAMESPACE")
    return ns


def cmd_chaos(args: argparse.Namespace) -> int:
    from ddiloco.run.root import MAX_DOC_BYTES, prepared_at_of  # torch: only for this command

    store = open_store(args.store)
    cfg = RunConfig.from_dict(store.get_json(keys.CONFIG))
    t0 = prepared_at_of(store.get_json_or_none(keys.DATA_META, max_bytes=MAX_DOC_BYTES)) or time.time()
    events = schedule_from_config(cfg.chaos, cfg.diloco.learners)
    if args.backend == "kubernetes":
        workflow = args.workflow or os.environ.get("DDILOCO_K8S_WORKFLOW", "")
        backend: Backend = KubernetesPods.connect(
            namespace(args.namespace), workflow, args.selector, args.kube_api
        )
    else:
        backend = LocalPids(args.store)
    runner = ChaosRunner(store, backend, events, t0, victim_wait_s=args.victim_wait)
    records = runner.run(poll_s=args.poll_seconds, max_seconds=args.max_seconds)
    if args.markdown_out:
        Path(args.markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown_out).write_text(markdown_table(records))
    log.info("chaos: %d event(s) recorded under chaos/%s/", len(records), backend.name)
    return 0


def register(subparsers: Any) -> None:
    """Add `ddiloco chaos` to the CLI."""
    p = subparsers.add_parser(
        "chaos", help="fire the run's timed chaos schedule at its learner/syncer pods (or local processes)"
    )
    p.add_argument("--store", required=True, help="run root, e.g. s3://bucket/prefix/run")
    p.add_argument("--backend", choices=["kubernetes", "local"], default="kubernetes")
    p.add_argument("--namespace", help="pods' namespace (default $DDILOCO_K8S_NAMESPACE, else this pod's)")
    p.add_argument(
        "--workflow",
        help=f"this run's Argo workflow (default $DDILOCO_K8S_WORKFLOW); pods need {WORKFLOW_LABEL}",
    )
    p.add_argument(
        "--selector", default=DEFAULT_SELECTOR, help=f"victims' label selector (default {DEFAULT_SELECTOR!r})"
    )
    p.add_argument("--poll-seconds", type=float, default=1.0, help="seconds between checks of the schedule")
    p.add_argument(
        "--victim-wait",
        type=float,
        default=120.0,
        help="seconds to wait for a victim to be running before skipping",
    )
    p.add_argument("--max-seconds", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--markdown-out", metavar="PATH", help="also write what happened as a Markdown table")
    p.add_argument("--kube-api", metavar="URL", help="talk to this API server URL (kubectl proxy, tests)")
    p.set_defaults(func=cmd_chaos)
