"""`ddiloco pipeline compile | submit | schedule`: compile the pipelines, run them on a KFP host, and manage
recurring runs. kfp is imported inside the handlers only, so `ddiloco` works without the `kfp` extra.

Cron: KFP's recurring runs take six fields with seconds first (`SEC MIN HOUR DAY-OF-MONTH MONTH DAY-OF-WEEK`,
e.g. "0 0 2 * * *" = every day at 02:00), not the five of Unix cron; `check_cron` says so and suggests the
six-field form when it is given five.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

CRON_FIELDS = (
    ("seconds", 0, 59),
    ("minutes", 0, 59),
    ("hours", 0, 23),
    ("day of month", 1, 31),
    ("month", 1, 12),
    ("day of week", 0, 6),
)
_NAMES = {
    "month": "JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split(),
    "day of week": "SUN MON TUE WED THU FRI SAT".split(),
}
_CRON_HELP = (
    "KFP cron expressions have 6 fields, seconds first: 'SECONDS MINUTES HOURS DAY-OF-MONTH MONTH DAY-OF-WEEK' "
    "(e.g. '0 0 2 * * *' = every day at 02:00, '0 30 */6 * * *' = every 6 hours at :30, '0 0 3 * * MON' = "
    "Mondays at 03:00)"
)


class PipelineCliError(ValueError):
    """A mistake in the command line; the message says what to change (printed as one line, exit 2)."""


# --- cron --------------------------------------------------------------------------------------------------
def check_cron(expr: str) -> str:
    """Validate a KFP (six-field, seconds-first) cron expression; return it normalised to single spaces."""
    fields = expr.split()
    if len(fields) == 5:
        raise PipelineCliError(
            f"cron {expr!r} has 5 fields (Unix cron). {_CRON_HELP}. The same schedule in KFP form: "
            f"'0 {' '.join(fields)}'"
        )
    if len(fields) != 6:
        raise PipelineCliError(f"cron {expr!r} has {len(fields)} fields. {_CRON_HELP}")
    for text, (name, lo, hi) in zip(fields, CRON_FIELDS, strict=True):
        _check_field(text, name, lo, hi, expr)
    return " ".join(fields)


def _value(token: str, name: str, lo: int, hi: int, expr: str) -> int:
    names = _NAMES.get(name, [])
    if token.upper() in names:
        return names.index(token.upper()) + lo
    if not token.isdigit() or not lo <= int(token) <= hi:
        raise PipelineCliError(f"cron {expr!r}: {name} field has {token!r}; use {lo}-{hi}. {_CRON_HELP}")
    return int(token)


def _check_field(text: str, name: str, lo: int, hi: int, expr: str) -> None:
    for part in text.split(","):
        if part == "?" and name in ("day of month", "day of week"):
            continue
        base, _, step = part.partition("/")
        if step and (not step.isdigit() or int(step) == 0):
            raise PipelineCliError(
                f"cron {expr!r}: {name} step {step!r} must be a positive number. {_CRON_HELP}"
            )
        if base == "*":
            continue
        start, dash, end = base.partition("-")
        a = _value(start, name, lo, hi, expr)
        if dash and _value(end, name, lo, hi, expr) < a:
            raise PipelineCliError(f"cron {expr!r}: {name} range {base!r} runs backwards. {_CRON_HELP}")


# --- parameters --------------------------------------------------------------------------------------------
def parse_params(items: list[str], known: dict[str, Any]) -> dict[str, Any]:
    """`key=value` pairs; values are YAML (`learners=8`, `overrides=[diloco.codec=int4]`, `chaos={events: []}`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise PipelineCliError(f"--param {item!r} must look like name=value, e.g. --param learners=8")
        if key not in known:
            raise PipelineCliError(
                f"unknown pipeline parameter {key!r}; parameters: {', '.join(sorted(known))}"
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise PipelineCliError(f"--param {key}: {raw!r} is not valid YAML ({e})") from None
        default = known[key]
        if isinstance(default, str) and not isinstance(value, str):
            value = raw if not isinstance(value, dict | list) else json.dumps(value)
        out[key] = value
    return out


def package_parameters(path: Path) -> dict[str, Any]:
    """The root input parameters (and defaults) of a compiled pipeline."""
    doc = next(yaml.safe_load_all(path.read_text()))
    params = doc.get("root", {}).get("inputDefinitions", {}).get("parameters", {})
    return {k: v.get("defaultValue") for k, v in params.items()}


# --- handlers ----------------------------------------------------------------------------------------------
def _require_kfp() -> None:
    try:
        import kfp  # noqa: F401
        import kfp.kubernetes  # noqa: F401
    except ImportError:
        raise PipelineCliError(
            "the pipeline commands need the kfp SDK: pip install 'ddiloco[kfp]' (kfp, kfp-kubernetes, kubernetes)"
        ) from None


def _compile_changes(args: argparse.Namespace) -> dict[str, Any]:
    hours = getattr(args, "run_timeout_hours", None)
    return {
        "registry": args.registry,
        "max_learners": args.max_learners,
        "tokenize_parallelism": getattr(args, "tokenize_parallelism", None),
        "gpus_per_learner": args.gpus_per_learner,
        "learner_nodes": getattr(args, "learner_nodes", None),
        "accelerator": args.accelerator,
        "learner_retries": args.learner_retries,
        "syncer_retries": args.syncer_retries,
        "learner_cpu": args.learner_cpu,
        "learner_memory": args.learner_memory,
        "learner_shm": getattr(args, "learner_shm", None),
        "syncer_cpu": args.syncer_cpu,
        "syncer_memory": args.syncer_memory,
        "run_timeout_s": None if hours is None else int(hours * 3600),
        "crash_restarts": getattr(args, "crash_restarts", None),
        "keeper": getattr(args, "keeper", None),
    }


def _checked_defaults(args: argparse.Namespace, changes: dict[str, Any]) -> dict[str, Any]:
    """The compile changes with `--param` as the run-time defaults of the package, checked before anything
    is written: each value against its parameter, and the run config prepare would build from them."""
    from ddiloco.components.runtime import check_run
    from ddiloco.pipelines.compile import BUILDERS, options
    from ddiloco.pipelines.pretrain import pipeline_function
    from ddiloco.pipelines.validate import check_types, kind_of

    opts = options(args.pipeline, **changes)
    inputs = BUILDERS.get(args.pipeline, pipeline_function)(opts).component_spec.inputs or {}
    known = {name: spec.default for name, spec in inputs.items()}
    params = parse_params(args.param, known)
    check_types(params, {name: kind_of(default) for name, default in known.items()})
    check_run(known | params, opts.max_learners, opts.learner_ranks)
    return {**changes, "defaults": {**opts.defaults, **params}} if params else changes


def _checked_params(args: argparse.Namespace, package: Path) -> dict[str, Any]:
    """`--param` of submit / schedule create, checked against the package before anything is sent."""
    from ddiloco.pipelines.validate import check_package

    params = parse_params(args.param, package_parameters(package))
    check_package(next(yaml.safe_load_all(package.read_text())) or {}, params)
    return params


def cmd_compile(args: argparse.Namespace) -> int:
    _require_kfp()
    from ddiloco.pipelines.compile import compile_pipeline

    changes = _checked_defaults(args, _compile_changes(args))
    out = compile_pipeline(args.pipeline, args.out or f"{args.pipeline}.yaml", **changes)
    print(out)
    return 0


def _package(args: argparse.Namespace, tmp: str) -> Path:
    """The pipeline package to send: --package FILE, or --pipeline NAME compiled now with the given options."""
    _require_kfp()
    if args.package:
        path = Path(args.package)
        if not path.is_file():
            raise PipelineCliError(
                f"--package {path} does not exist; compile one with `ddiloco pipeline compile`"
            )
        return path
    from ddiloco.pipelines.compile import compile_pipeline

    return compile_pipeline(args.pipeline, Path(tmp) / f"{args.pipeline}.yaml", **_compile_changes(args))


def _client(args: argparse.Namespace) -> Any:
    _require_kfp()
    import kfp
    import urllib3

    if not args.host:
        raise PipelineCliError("no KFP host: pass --host URL or set KFP_HOST (e.g. http://localhost:8080)")
    try:  # the client asks the API's healthz at once
        return kfp.Client(host=args.host, namespace=args.namespace, existing_token=args.token or None)
    except urllib3.exceptions.MaxRetryError as e:
        raise PipelineCliError(
            f"no KFP API answers at {args.host} ({e.reason}): check --host / KFP_HOST (e.g. "
            "`kubectl -n kubeflow port-forward svc/ml-pipeline-ui 8080:80` and http://localhost:8080)"
        ) from None


def _experiment_id(client: Any, name: str, namespace: str | None) -> str:
    try:
        return client.get_experiment(experiment_name=name, namespace=namespace).experiment_id
    except ValueError:  # kfp raises ValueError when no experiment has that name
        return client.create_experiment(name, namespace=namespace).experiment_id


def cmd_submit(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        package = _package(args, tmp)
        params = _checked_params(args, package)
        client = _client(args)
        result = client.create_run_from_pipeline_package(
            str(package),
            arguments=params,
            run_name=args.run_name,
            experiment_name=args.experiment,
            namespace=args.namespace,
            enable_caching=False,
        )
    print(
        json.dumps(
            {"run_id": result.run_id, "url": f"{args.host.rstrip('/')}/#/runs/details/{result.run_id}"}
        )
    )
    return 0


def cmd_schedule_create(args: argparse.Namespace) -> int:
    cron = check_cron(args.cron) if args.cron else None
    if (cron is None) == (args.interval_seconds is None):
        raise PipelineCliError(f"give exactly one of --cron or --interval-seconds. {_CRON_HELP}")
    with tempfile.TemporaryDirectory() as tmp:
        package = _package(args, tmp)
        params = _checked_params(args, package)
        client = _client(args)
        rr = client.create_recurring_run(
            experiment_id=_experiment_id(client, args.experiment, args.namespace),
            job_name=args.name,
            description=args.description,
            cron_expression=cron,
            interval_second=args.interval_seconds,
            max_concurrency=args.max_concurrency,
            no_catchup=not args.catchup,
            params=params,
            pipeline_package_path=str(package),
            enabled=True,
            enable_caching=False,
        )
    print(json.dumps({"recurring_run_id": rr.recurring_run_id, "name": args.name, "cron": cron}))
    return 0


def cmd_schedule_list(args: argparse.Namespace) -> int:
    client = _client(args)
    exp = _experiment_id(client, args.experiment, args.namespace) if args.experiment else None
    resp = client.list_recurring_runs(page_size=args.page_size, experiment_id=exp, namespace=args.namespace)
    for rr in resp.recurring_runs or []:
        trigger = rr.trigger
        when = (trigger.cron_schedule.cron if trigger and trigger.cron_schedule else None) or (
            f"every {trigger.periodic_schedule.interval_second}s"
            if trigger and trigger.periodic_schedule
            else "?"
        )
        print(f"{rr.recurring_run_id}\t{rr.status or '?'}\t{when}\t{rr.display_name}")
    return 0


def cmd_schedule_disable(args: argparse.Namespace) -> int:
    _client(args).disable_recurring_run(args.recurring_run_id)
    print(json.dumps({"recurring_run_id": args.recurring_run_id, "status": "DISABLED"}))
    return 0


def cmd_schedule_enable(args: argparse.Namespace) -> int:
    _client(args).enable_recurring_run(args.recurring_run_id)
    print(json.dumps({"recurring_run_id": args.recurring_run_id, "status": "ENABLED"}))
    return 0


# --- parser ------------------------------------------------------------------------------------------------
def _compile_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("compile-time options (default: the named pipeline's)")
    g.add_argument("--pipeline", choices=["pretrain", "smoke", "join"], default="pretrain")
    g.add_argument(
        "--registry", help="image registry, e.g. ghcr.io/you (images: REGISTRY/ddiloco-learner:VERSION)"
    )
    g.add_argument(
        "--max-learners", type=int, help="ParallelFor parallelism: the most learners a run may have"
    )
    g.add_argument(
        "--tokenize-parallelism", type=int, help="tokenize-unit pods at once when a run gives text_corpus"
    )
    g.add_argument("--gpus-per-learner", type=int, help="GPUs of a learner pod, or of each node of one")
    g.add_argument(
        "--learner-nodes",
        type=int,
        help="pods per learner (default 1); above 1 each learner is a Kubeflow Trainer TrainJob of that many "
        "nodes under torchrun (needs Kubeflow Trainer's torch-distributed runtime, and train.ranks ≥ nodes × "
        "GPUs per learner)",
    )
    g.add_argument("--accelerator", help="GPU resource name (default nvidia.com/gpu)")
    g.add_argument("--learner-retries", type=int)
    g.add_argument("--syncer-retries", type=int)
    g.add_argument("--learner-cpu")
    g.add_argument("--learner-memory")
    g.add_argument(
        "--learner-shm",
        help="memory-backed /dev/shm of GPU learner pods (NCCL), e.g. 4Gi (default); '' for none",
    )
    g.add_argument("--syncer-cpu")
    g.add_argument("--syncer-memory")
    g.add_argument(
        "--run-timeout-hours",
        type=float,
        help="deadline of each learner / syncer / chaos pod, and the window in which any step is retried",
    )
    g.add_argument("--crash-restarts", type=int, help="restarts of a crashed learner/syncer (after its exit)")
    g.add_argument(
        "--no-keeper",
        dest="keeper",
        action="store_const",
        const=False,
        help="run learners and the syncer in their KFP task pods, without keeper pods (only on a cluster with "
        "manifests/argo-retry: stock KFP 2.17 then retries no preempted, evicted or OOM-killed pod)",
    )


def _host_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=os.environ.get("KFP_HOST"), help="KFP API/UI URL (default $KFP_HOST)")
    p.add_argument(
        "--namespace", default=os.environ.get("KFP_NAMESPACE"), help="profile namespace (multi-user)"
    )
    p.add_argument("--token", default=os.environ.get("KFP_TOKEN"), help="bearer token (default $KFP_TOKEN)")


def _run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--package", help="a compiled pipeline YAML instead of compiling --pipeline now")
    p.add_argument("--experiment", default="ddiloco", help="experiment name (created when missing)")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="pipeline parameter, YAML value (repeatable), checked before anything is sent (an unknown override "
        "key gets a did-you-mean): --param learners=8 --param 'overrides=[diloco.codec=int4]'",
    )


def register(subparsers: Any) -> None:
    """Add `ddiloco pipeline …` to the CLI (kfp is imported only when a command runs)."""
    pipeline = subparsers.add_parser("pipeline", help="compile, submit and schedule the Kubeflow pipelines")
    sub = pipeline.add_subparsers(dest="pipeline_command", required=True)

    p = sub.add_parser("compile", help="compile a pipeline to KFP YAML (upload it in the KFP UI)")
    _compile_flags(p)
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="run-time parameter default of the package, YAML value (repeatable), checked like at submit: "
        "--param learners=8 --param 'overrides=[diloco.codec=int4]'",
    )
    p.add_argument("--out", help="output file (default PIPELINE.yaml)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("submit", help="start a run on a KFP host")
    _compile_flags(p)
    _host_flags(p)
    _run_flags(p)
    p.add_argument("--run-name", help="display name of the run")
    p.set_defaults(func=cmd_submit)

    sched = sub.add_parser("schedule", help="recurring runs: create | list | disable | enable")
    ssub = sched.add_subparsers(dest="schedule_command", required=True)
    p = ssub.add_parser("create", help="create a recurring run (cron: 6 fields, seconds first)")
    _compile_flags(p)
    _host_flags(p)
    _run_flags(p)
    p.add_argument("--name", required=True, help="recurring run name")
    p.add_argument("--description")
    p.add_argument("--cron", help="KFP cron, 6 fields, seconds first: '0 0 2 * * *' = daily at 02:00")
    p.add_argument("--interval-seconds", type=int, help="or: run every N seconds")
    p.add_argument("--max-concurrency", type=int, default=1, help="runs of this schedule at once (default 1)")
    p.add_argument("--catchup", action="store_true", help="backfill runs missed while paused (default off)")
    p.set_defaults(func=cmd_schedule_create)
    p = ssub.add_parser("list", help="list recurring runs")
    _host_flags(p)
    p.add_argument("--experiment", help="only this experiment's")
    p.add_argument("--page-size", type=int, default=100)
    p.set_defaults(func=cmd_schedule_list)
    for verb, func in (("disable", cmd_schedule_disable), ("enable", cmd_schedule_enable)):
        p = ssub.add_parser(verb, help=f"{verb} a recurring run")
        _host_flags(p)
        p.add_argument("recurring_run_id")
        p.set_defaults(func=func)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m ddiloco.pipelines.cli …`), same commands as `ddiloco pipeline …`."""
    parser = argparse.ArgumentParser(prog="ddiloco")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
