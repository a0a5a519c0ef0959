"""The header of an update (a learner's answer to a round): what the learner signs and the syncer reads.

Design choices:
- One dataclass, `UpdateHeader`, for both sides: the learner builds one and packs `to_json()`
  (`ddiloco.learner.io.pack_update` adds the decoded `norms` and the int4/int2 `packing`); the syncer reads
  one with `from_json` from a payload `wire.unpack` verified (`run_id`, `kind` and `fragment_id` are checked
  there against the round's).
- `from_json` checks the types of the fields the syncer reads, in one place: a counter that is not a
  non-negative integer, a `c_seconds` that is not a finite duration or a missing `codec` is a PayloadError
  `malformed` naming the field. `wait_s` is the learner's own clock and only paces the grace window: a value
  that is not a non-negative number reads as 0. `norms` and `packing` are kept as written (the merge and
  `ddiloco.protocol.validation.packing` judge them).
- Every field has a default (an empty answer), so an answer built in memory names only what it needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddiloco.protocol.wire import PayloadError

COUNTERS = (
    "learner_id",
    "incarnation",
    "fragment_id",
    "round",
    "base_version",
    "c_steps",
    "c_tokens",
    "inner_step",
)
"""The integer fields, each in [0, 2^62)."""
_WRITTEN = ("run_id", "kind", *COUNTERS[:7], "c_seconds", "inner_step", "codec", "wait_s")
"""The fields `to_json` writes, in the order the learner writes them."""


@dataclass(slots=True)
class UpdateHeader:
    """An update's header: who answered which round of which fragment, on which base version, with the
    counters (steps, tokens, seconds) since that base, the upload codec and the learner's own wait."""

    run_id: str = ""
    kind: str = "update"
    learner_id: int = 0
    incarnation: int = 0
    fragment_id: int = 0
    round: int = 0
    base_version: int = 0
    c_steps: int = 0
    c_tokens: int = 0
    c_seconds: float = 0.0
    inner_step: int = 0
    codec: str = "fp32"
    wait_s: float = 0.0
    """Seconds from this learner first seeing the round open to answering it (its own clock)."""
    norms: dict[str, Any] | None = None
    """tensor name -> L2 norm of its decoded delta (added at packing; None in a header not yet packed)."""
    packing: Any = None
    """How int4/int2 codes are packed (`ddiloco.codec.blockwise.PACKING`); None when the header has none."""

    def to_json(self) -> dict[str, Any]:
        """The header as the learner packs it (without `norms` and `packing`, which packing adds)."""
        return {f: getattr(self, f) for f in _WRITTEN}

    @classmethod
    def from_json(cls, meta: Mapping[str, Any]) -> UpdateHeader:
        """The header of a verified payload, its fields' types checked (module docstring)."""
        counters = {}
        for f in COUNTERS:
            v = meta.get(f)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 62:
                raise PayloadError(
                    "malformed", f"header field {f}={str(v)[:40]!r} is not a non-negative integer"
                )
            counters[f] = v
        s = meta.get("c_seconds")
        if not isinstance(s, int | float) or isinstance(s, bool) or not math.isfinite(s) or s < 0:
            raise PayloadError("malformed", f"header field c_seconds={str(s)[:40]!r} is not a duration")
        codec = meta.get("codec")
        if not isinstance(codec, str):
            raise PayloadError("malformed", "header has no codec")
        w = meta.get("wait_s", 0.0)
        wait = float(w) if isinstance(w, int | float) and not isinstance(w, bool) and w >= 0 else 0.0
        return cls(
            run_id=str(meta.get("run_id", "")),
            kind=str(meta.get("kind", "update")),
            c_seconds=s,
            codec=codec,
            wait_s=wait,
            norms=meta.get("norms"),
            packing=meta.get("packing"),
            **counters,
        )
