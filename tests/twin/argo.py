"""Argo Workflows v4.0.5 as KFP 2.17 drives it: retry strategies, template defaults, retry decisions, names.

Design choices:
- `retry_decision` is `processNodeRetries` as a pure function of the retry strategy (as Argo holds it after
  template substitution: strings), the attempts so far and "now" (cluster seconds). The twin's controller
  calls
  it whenever the last attempt of a task has ended and again when a backoff it asked for has passed, as
  Argo's requeueAfter does.
- The executor (`system-container-impl`) template's pods are decided here; the retry nodes templateDefaults
  put above KFP's DAG templates are in dagretry.py. KFP's driver pods are not run (their retry node would
  not change a deterministic driver failure: a Failed pod, which OnError does not retry).

Rules and their sources:
- KFP backend/src/v2/compiler/argocompiler/container.go getTaskRetryParametersWithValues +
  getTaskRetryStrategyFromInput: limit = maxRetryCount, backoff.duration = backoffDuration *seconds* (an
  integer string), backoff.factor = `%v` of the float (2.0 -> "2", 1.5 -> "1.5"), backoff.maxDuration =
  backoffMaxDuration seconds; a missing duration/maxDuration gets the template parameter default "0"
  (addParameterDefault). No retryPolicy is set.
- Argo workflow/controller/operator.go mergedTemplateDefaultsInto: `spec.templateDefaults` (from the
  controller's workflowDefaults, controller.go setWorkflowDefaults) is strategic-merged *under* every
  template: the template's own fields win, missing ones (e.g. retryPolicy) come from the defaults.
  operator.go retryStrategy(): a template without one falls back to the workflow's spec.retryStrategy.
- operator.go processNodeRetries, in this order: last attempt succeeded -> Succeeded; workflow
  shutdown/deadline -> stop ("retry exceeded workflow deadline"); with a backoff: maxDuration deadline =
  FIRST attempt's StartedAt + maxDuration, past it -> "Max duration limit exceeded"; no duration -> error
  "no base duration specified for retryStrategy"; factor parsed with intstr.Int32 (a non-integer string is an
  error: "value '1.5' cannot be resolved to an int"); wait = duration * factor^(attempts-1) (factor > 0,
  else duration); cap; waiting deadline = last FinishedAt + wait; after the maxDuration deadline ->
  "Backoff would exceed max duration limit"; before it and attempts <= limit -> wait (requeueAfter);
  executionDeadline of the next attempt = the maxDuration deadline. Then retryPolicy
  (RetryPolicyActual: Always, OnError, OnFailure - the default without an expression - , OnTransientError):
  a Failed attempt needs OnFailure/Always, an Error attempt OnError/Always, else "not set to be retried"
  (the node takes the attempt's phase and message); limit parsed with intstr.Int32; attempts > limit ->
  "No more retries left"; otherwise a new attempt. Note: a policy that will not retry still waits out
  the backoff first.
- pkg/apis/workflow/v1alpha1/workflow_types.go RetryPolicyActual; util/errors/errors.go IsTransientErr
  (the message patterns below, plus TRANSIENT_ERROR_PATTERN).
- operator.go executeTemplate: attempt N of a retried template is node `<name>(N)`; workflow/util/pod_name.go
  GeneratePodName (POD_NAMES v2, the default): `<workflow>-<template>-<fnv32a(node name)>`, the prefix cut
  to 242 characters; workflow_types.go NodeID: `<workflow>-<fnv32a(node name)>`.
- dag.go taskNodeName: `<parent node>.<task>`; operator.go generateNodeName: expanded items
  `<task>(<index>:<item>)`; common/util.go GenerateOnExitNodeName: `<parent>.onExit`.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from tests.twin.gofmt import fmt_v, intstr_int, intstr_int_value, parse_duration, proto_duration_seconds
from tests.twin.ir import TwinUnsupported

MAX_PREFIX = 253 - 10
_TRANSIENT = (
    "exceeded quota",
    "Operation cannot be fulfilled on resourcequota",
    "resource quota evaluation timed out",
    "etcdserver: leader changed",
    "etcdserver: request timed out",
    "etcdserver: too many requests",
    "Connection closed by foreign host",
    "net/http: TLS handshake timeout",
    "i/o timeout",
    "connection timed out",
    "connection reset by peer",
    "http2: client connection lost",
    "http2: server sent GOAWAY and closed the connection",
    "connect: connection refused",
    "invalid connection",
)


def fnv32a(text: str) -> int:
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def node_id(workflow: str, node_name: str) -> str:
    return workflow if node_name == workflow else f"{workflow}-{fnv32a(node_name)}"


def pod_name(workflow: str, node_name: str, template: str) -> str:
    """GeneratePodName, POD_NAMES=v2."""
    if workflow == node_name:
        return workflow
    prefix = f"{workflow}-{template}" if template else workflow
    return f"{prefix[: MAX_PREFIX - 1]}-{fnv32a(node_name)}"


def expanded_name(task: str, index: int, item: Any) -> str:
    """generateNodeName for a withSequence/withItems item (parentheses removed from the item)."""
    return f"{task}({index}:{str(item).replace('(', '').replace(')', '')})"


def kfp_retry_strategy(task: dict[str, Any]) -> dict[str, Any] | None:
    """The executor template's retryStrategy after Argo substitutes KFP's retry parameters."""
    rp = task.get("retryPolicy")
    if rp is None:
        return None
    dur = str(proto_duration_seconds(rp["backoffDuration"])) if rp.get("backoffDuration") else "0"
    maxd = str(proto_duration_seconds(rp["backoffMaxDuration"])) if rp.get("backoffMaxDuration") else "0"
    backoff = {"duration": dur, "factor": fmt_v(float(rp.get("backoffFactor", 0.0))), "maxDuration": maxd}
    return {"limit": fmt_v(int(rp.get("maxRetryCount", 0))), "backoff": backoff}


def _strategic_merge(defaults: Any, template: Any) -> Any:
    if isinstance(defaults, dict) and isinstance(template, dict):
        out = copy.deepcopy(defaults)
        for k, v in template.items():
            out[k] = _strategic_merge(out.get(k), v)
        return out
    return copy.deepcopy(template)


def effective_retry_strategy(
    template_strategy: dict[str, Any] | None, workflow_defaults: dict[str, Any] | None
) -> dict[str, Any] | None:
    """mergedTemplateDefaultsInto + woc.retryStrategy for the executor template."""
    spec = (workflow_defaults or {}).get("spec", {}) or {}
    tdefaults = spec.get("templateDefaults") or {}
    unknown = sorted(set(tdefaults) - {"retryStrategy", "metadata"})
    if unknown:
        raise TwinUnsupported(f"workflowDefaults.spec.templateDefaults {unknown} are not modelled")
    template = {"retryStrategy": template_strategy} if template_strategy is not None else {}
    merged = _strategic_merge({k: v for k, v in tdefaults.items() if k == "retryStrategy"}, template)
    strategy = merged.get("retryStrategy") or spec.get("retryStrategy")
    if strategy and strategy.get("expression"):
        raise TwinUnsupported("retryStrategy.expression is not modelled")
    return strategy


def retry_policy_actual(strategy: dict[str, Any]) -> str:
    if strategy.get("retryPolicy"):
        return strategy["retryPolicy"]
    return "OnFailure" if not strategy.get("expression") else "Always"


@dataclass
class AttemptView:
    phase: str
    message: str
    started: float
    finished: float


@dataclass
class Decision:
    action: str
    """succeeded | wait | retry | fail | error"""
    phase: str = ""
    message: str = ""
    until: float | None = None
    execution_deadline: float | None = None
    reason: str = ""
    """why the twin recorded this outcome (for "fail": which rule stopped the retries)"""


def retry_decision(
    strategy: dict[str, Any],
    attempts: list[AttemptView],
    now: float,
    *,
    deadline_exceeded: bool = False,
    transient_pattern: str | None = None,
) -> Decision:
    """operator.go processNodeRetries for a retry node whose last attempt has ended."""
    last = attempts[-1]
    if last.phase == "Succeeded":
        return Decision("succeeded", "Succeeded")
    if deadline_exceeded:
        return Decision("fail", last.phase, "retry exceeded workflow deadline")
    execution_deadline = None
    backoff = strategy.get("backoff")
    try:
        if backoff is not None:
            max_deadline = None
            if backoff.get("maxDuration"):
                max_deadline = attempts[0].started + parse_duration(str(backoff["maxDuration"]))
                if now > max_deadline:
                    return Decision("fail", last.phase, "Max duration limit exceeded")
            if not backoff.get("duration"):
                return Decision("error", "Error", "no base duration specified for retryStrategy")
            wait = parse_duration(str(backoff["duration"]))
            factor = intstr_int(backoff.get("factor"))
            if factor is not None and factor > 0:
                wait = wait * int(float(factor) ** (len(attempts) - 1))
            if backoff.get("cap"):
                wait = min(wait, parse_duration(str(backoff["cap"])))
            waiting_deadline = last.finished + wait
            if max_deadline is not None and waiting_deadline > max_deadline:
                return Decision("fail", last.phase, "Backoff would exceed max duration limit")
            limit = strategy.get("limit")
            if now < waiting_deadline and limit is not None and len(attempts) <= intstr_int_value(limit):
                return Decision("wait", until=waiting_deadline, message=f"Backoff for {wait:g}s")
            execution_deadline = max_deadline
        policy = retry_policy_actual(strategy)
        if policy == "Always":
            on_failed = on_error = True
        elif policy == "OnError":
            on_failed, on_error = False, True
        elif policy == "OnFailure":
            on_failed, on_error = True, False
        elif policy == "OnTransientError":
            transient = any(p in last.message for p in _TRANSIENT) or bool(
                transient_pattern and re.search(transient_pattern, last.message)
            )
            on_failed = on_error = transient
        else:
            return Decision("error", "Error", f"{policy} is not a valid RetryPolicy")
        if (last.phase == "Failed" and not on_failed) or (last.phase == "Error" and not on_error):
            why = f"not retried: retryPolicy {policy} does not retry a {last.phase} pod"
            return Decision("fail", last.phase, last.message, reason=why)
        limit = intstr_int(strategy.get("limit"))
        if limit is not None and len(attempts) > limit:
            return Decision("fail", last.phase, "No more retries left")
    except ValueError as e:
        return Decision("error", "Error", str(e))
    return Decision("retry", execution_deadline=execution_deadline)
