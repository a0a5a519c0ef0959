"""Every number the syncer reads from a learner report, checked: reports are plain, unsigned JSON.

A report that lacks the fields the syncer needs, or has them with unusable types, is ignored whole
(`validation.report_ok`). Past that, each number the syncer reads (pacing, liveness, goodput, the mean
loss, the books) must be finite, in range and of a plausible size; a number that is not (NaN, ±inf, a
negative duration, a step of more than `MAX_STEP_S`) is dropped: `clean` treats the field as missing, as a
report from before the field existed would have it, and names it so the caller can log and count it.
Pacing therefore only ever sees positive, finite step times (`Roster.measured_step`), so no report can
open a round on every pass (a negative cadence) or stop rounds from opening (NaN or a huge one). What the
syncer keeps of a checked report is a `CheckedReport`: the report is read once, its readers use attributes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddiloco.protocol import chiptime

MAX_STEP_S = 3600.0
"""Seconds per step beyond which a reported cadence is absurd (a 1b step takes about a second)."""
MAX_COUNT = 1 << 62
MAX_LOSS = 1e6
MAX_MFU = 100.0
"""An MFU above 1 means a wrong `train.peak_flops`; far above, a report not worth reading."""

# field -> (lowest allowed, whether the lowest is excluded, highest allowed, value when dropped)
_TOP: dict[str, tuple[float, bool, float, Any]] = {
    "step_wall_ema": (0.0, True, MAX_STEP_S, None),
    "step_time_ema": (0.0, True, MAX_STEP_S, None),
    "productive_seconds": (0.0, False, math.inf, None),
    "busy_seconds": (0.0, False, math.inf, None),
    "joined_at": (-math.inf, False, math.inf, None),
    "tokens_processed": (0, False, MAX_COUNT, None),
    "seq": (0, False, MAX_COUNT, None),
    "loss_ema": (0.0, False, MAX_LOSS, None),
    "loss": (0.0, False, MAX_LOSS, None),
    "tokens_per_s": (0.0, False, MAX_COUNT, None),
    "mfu": (0.0, False, MAX_MFU, None),
    "peak_flops": (0.0, True, math.inf, None),
}
_FRAGMENT: dict[str, tuple[float, bool, float, Any]] = {
    "discarded_tokens": (0, False, MAX_COUNT, 0),
    "merged_seconds": (0.0, False, math.inf, 0.0),
}
_REQUIRED = ("time", "started_at")


def _usable(v: Any, low: float, open_low: bool, high: float) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    return math.isfinite(v) and (v > low if open_low else v >= low) and v <= high


def times_finite(report: dict[str, Any]) -> bool:
    """The times every report must have are finite (else the report is malformed)."""
    return all(_usable(report[k], -math.inf, False, math.inf) for k in _REQUIRED)


def clean(report: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The report with every unusable number dropped (module docstring), and the names of those dropped
    (`fragments.<p>.<field>` for a fragment's books). The report itself is not changed."""
    out, dropped = dict(report), []
    for k, (low, open_low, high, missing) in _TOP.items():
        v = out.get(k)
        if v is not None and not _usable(v, low, open_low, high):
            out[k] = missing
            dropped.append(k)
    frags = {}
    for p, books in report["fragments"].items():
        books = dict(books)
        for k, (low, open_low, high, missing) in _FRAGMENT.items():
            if not _usable(books[k], low, open_low, high):
                books[k] = missing
                dropped.append(f"fragments.{p}.{k}")
        frags[p] = books
    out["fragments"] = frags
    return out, dropped


@dataclass(frozen=True, slots=True)
class CheckedReport:
    """A learner report as the syncer reads it, once `report_ok`, `times_finite` and `clean` passed it: the
    numbers pacing, liveness, goodput, the mean loss and the books use. None where the report lacks a number
    or it was dropped; `final` is whether the report says so."""

    learner_id: int
    incarnation: int
    seq: int | None
    time: float
    started_at: float
    joined_at: float | None
    final: bool
    exit_reason: str | None
    tokens_processed: int | None
    productive_seconds: float | None
    busy_seconds: float | None
    loss_ema: float | None
    cadence: float | None
    """Wall seconds per step (`chiptime.cadence`); None until measured."""
    discarded_tokens: dict[str, float]
    """fragment -> tokens the learner reports discarded there (0 where the number was dropped)."""
    tokens_per_s: float | None = None
    """Processed tokens per second (`ddiloco.learner.efficiency`)."""
    mfu: float | None = None
    peak_flops: float | None = None
    """Peak FLOP/s of the learner's devices together; with `mfu`, what the fleet's MFU weighs by."""

    @classmethod
    def of(cls, cleaned: Mapping[str, Any]) -> CheckedReport:
        """The view of a report `clean` returned."""
        seq = cleaned.get("seq")
        return cls(
            learner_id=cleaned["learner_id"],
            incarnation=cleaned["incarnation"],
            seq=None if seq is None else int(seq),
            time=cleaned["time"],
            started_at=cleaned["started_at"],
            joined_at=cleaned.get("joined_at"),
            final=bool(cleaned.get("final")),
            exit_reason=cleaned.get("exit_reason"),
            tokens_processed=cleaned.get("tokens_processed"),
            productive_seconds=cleaned.get("productive_seconds"),
            busy_seconds=cleaned.get("busy_seconds"),
            loss_ema=cleaned.get("loss_ema"),
            cadence=chiptime.cadence(cleaned),
            discarded_tokens={p: books["discarded_tokens"] for p, books in cleaned["fragments"].items()},
            tokens_per_s=cleaned.get("tokens_per_s"),
            mfu=cleaned.get("mfu"),
            peak_flops=cleaned.get("peak_flops"),
        )
