"""The run's efficiency from the learners' reports: processed tokens/s, MFU, data-loader wait, peak memory.

Design choices:
- Per learner id, over its incarnations: `processed_tokens_per_s` = tokens processed / productive seconds (time
  in the training loop, `ddiloco.protocol.chiptime`); `mfu` = Σ flops_per_token·tokens / Σ peak FLOP/s·productive
  seconds over the incarnations whose peak is known (`ddiloco.learner.efficiency`), None when none is;
  `data_wait_fraction` = seconds waiting for batches / seconds in inner steps; `peak_memory_bytes` the largest
  incarnation's, with its `peak_memory_kind` (`cuda_max_allocated` or `peak_rss`).
- The fleet: `processed_tokens_per_s` = tokens processed by every learner / the run's wall seconds (what the
  fleet trained per second of the run); `mfu` the same ratio of sums over every learner (time lost to failures
  is goodput's business, not MFU's); `data_wait_fraction` over every learner's step seconds; `peak_memory_bytes`
  the largest learner's. Reports from before the fields count as unknown, never as 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ddiloco.protocol import chiptime
from ddiloco.protocol.learner_report import LearnerReport

FIELDS = ("processed_tokens_per_s", "mfu", "data_wait_fraction", "peak_memory_bytes", "peak_memory_kind")
"""What `learner_efficiency` and `fleet_efficiency` say, in summary.json."""


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _sums(incarnations: Iterable[LearnerReport]) -> dict[str, Any]:
    s: dict[str, Any] = {"tokens": 0, "seconds": 0.0, "flops": 0.0, "peak": 0.0, "wait": 0.0, "busy": 0.0}
    s["memory"] = None
    for r in incarnations:
        seconds = chiptime.productive_seconds(r)
        s["tokens"] += r.tokens_processed
        s["seconds"] += seconds
        if r.peak_flops and r.flops_per_token:
            s["flops"] += r.flops_per_token * r.tokens_processed
            s["peak"] += r.peak_flops * seconds
        if r.data_wait_seconds is not None:
            s["wait"] += r.data_wait_seconds
            s["busy"] += r.busy_seconds
        if r.peak_memory_bytes is not None and (s["memory"] is None or r.peak_memory_bytes > s["memory"][0]):
            s["memory"] = (r.peak_memory_bytes, r.peak_memory_kind)
    return s


def _figures(s: dict[str, Any], tokens_per_s: float | None) -> dict[str, Any]:
    memory, kind = s["memory"] or (None, None)
    return {
        "processed_tokens_per_s": tokens_per_s,
        "mfu": _ratio(s["flops"], s["peak"]),
        "data_wait_fraction": _ratio(s["wait"], s["busy"]),
        "peak_memory_bytes": memory,
        "peak_memory_kind": kind,
    }


def learner_efficiency(incarnations: list[LearnerReport]) -> dict[str, Any]:
    """One learner id's figures over its incarnations (module docstring)."""
    s = _sums(incarnations)
    return _figures(s, _ratio(s["tokens"], s["seconds"]))


def fleet_efficiency(reports: list[LearnerReport], wall_seconds: float | None) -> dict[str, Any]:
    """Every learner's figures together (module docstring); `wall_seconds`: the run's."""
    s = _sums(reports)
    return _figures(s, _ratio(s["tokens"], wall_seconds or 0.0))
