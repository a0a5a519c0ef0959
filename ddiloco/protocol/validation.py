"""What the syncer accepts from learners: checks on an update's header, counters and tensors, and the
robust-mode clipping of outer gradients. Pure functions (no I/O), so every rule is unit-testable.

A rejected update is counted by reason (in metrics, the status object and the summary): not an intact
payload, too large, another run's, unsigned or badly signed, the wrong kind or fragment, a replay, the wrong
codec, impossible counters, a base that is unpublished, too stale or pruned, steps from the future, steps
already credited, the wrong shapes, non-finite values. The steps-in-the-future bounds never trust the
learner's wall clock. Robust mode (`diloco.robust_clip = c`) scales each outer gradient longer than c × the
round's median norm down to that length and counts it under `clipped`.

Design notes (every reason, the bounds on steps, why clipping spares honest answers): docs/internals.md,
"What the syncer accepts".
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ddiloco.codec import registry
from ddiloco.codec.base import all_finite
from ddiloco.codec.encoded import EncodedTensor
from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.wire import PayloadError

MIN_STEP_SECONDS = 1e-5
TIME_SLACK_S = 1.0
TIME_SLACK_FRACTION = 0.05


def header_fields(meta: Mapping[str, Any]) -> UpdateHeader:
    """The update's header, typed, once the fields the syncer reads have the right types (anything else is
    `malformed`: `ddiloco.protocol.update.UpdateHeader.from_json`)."""
    return UpdateHeader.from_json(meta)


def identity(header: UpdateHeader, named: tuple[int, int], round_: int) -> None:
    """An authentic update must sit under its own learner's name and its own round (else `replay`)."""
    if (header.learner_id, header.incarnation) != named:
        raise PayloadError(
            "replay",
            f"update of learner {header.learner_id}-{header.incarnation} filed as {named[0]}-{named[1]}",
        )
    if header.round != round_:
        raise PayloadError("replay", f"update of round {header.round} filed under round {round_}")


def packing(codec: Any, packed: Any, what: str) -> None:
    """Codes must be packed as this version packs them (`Codec.packing`: int4/int2 block-planar): a payload
    of another layout would decode to valid-looking wrong values, so it is refused by name (`bad_codec`).
    `codec`, `packed`: the payload header's `codec` and `packing` (None when it has none)."""
    wanted = registry.get(codec).packing if codec in registry.names() else None
    if wanted is not None and packed != wanted:
        was = "interleaved (an older ddiloco)" if packed is None else packed
        raise PayloadError(
            "bad_codec",
            f"{what}: {codec} codes packed {str(was)[:40]}"
            f", this ddiloco reads {wanted!r}; run learners and syncer of the same ddiloco version",
        )


def counters(header: UpdateHeader, *, codec: str, tokens_per_step: int, latest_version: int) -> None:
    if header.codec != codec:
        raise PayloadError("bad_codec", f"codec {header.codec[:20]!r}, the run uses {codec!r}")
    packing(header.codec, header.packing, "update")
    steps, tokens = header.c_steps, header.c_tokens
    if not (steps >= 1 and 0 < tokens <= steps * tokens_per_step):
        raise PayloadError(
            "bad_counters", f"c_steps={steps} c_tokens={tokens} (≤ {tokens_per_step} tokens per step)"
        )
    if header.base_version > latest_version:
        raise PayloadError(
            "bad_base", f"base_version {header.base_version} is newer than the latest ({latest_version})"
        )


def staleness(header: UpdateHeader, *, latest_version: int, max_staleness: int | None) -> None:
    """An answer built on a base more than `max_staleness` versions behind is `too_stale` (None: any)."""
    behind = latest_version - header.base_version
    if max_staleness is not None and behind > max_staleness:
        raise PayloadError(
            "too_stale",
            f"base_version {header.base_version} is {behind} versions behind (diloco.max_staleness={max_staleness})",
        )


class StepClock:
    """Per (contributor, fragment): (inner_step, base_version, c_steps) of the last accepted answer."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._last: OrderedDict[tuple[str, int], tuple[int, int, int]] = OrderedDict()

    def check(self, contributor: str, header: UpdateHeader, published_at: float | None, now: float) -> None:
        steps, inner, seconds, base = header.c_steps, header.inner_step, header.c_seconds, header.base_version
        if steps > inner:
            raise PayloadError("future_steps", f"c_steps={steps} exceeds the learner's inner_step={inner}")
        if steps * MIN_STEP_SECONDS > seconds:
            raise PayloadError(
                "future_steps", f"{steps} steps in {seconds:.6f}s is faster than physically possible"
            )
        if published_at is not None:
            age = max(0.0, now - published_at)
            if seconds > age * (1 + TIME_SLACK_FRACTION) + TIME_SLACK_S:
                raise PayloadError(
                    "future_steps", f"c_seconds={seconds:.1f} but base version {base} exists for {age:.1f}s"
                )
        prev = self._last.get((contributor, header.fragment_id))
        if prev is None:
            return
        inner0, base0, steps0 = prev
        if inner < inner0 or base < base0:
            raise PayloadError("future_steps", f"counters go backwards (inner_step {inner0} -> {inner})")
        if base == base0 and steps != steps0 + (inner - inner0):
            raise PayloadError(
                "future_steps",
                f"c_steps={steps}, expected {steps0 + inner - inner0} from the previous answer",
            )
        if base > base0 and steps > inner - inner0:
            raise PayloadError("future_steps", f"c_steps={steps} since inner_step {inner0}, now {inner}")

    def record(self, contributor: str, header: UpdateHeader) -> None:
        key = (contributor, header.fragment_id)
        self._last[key] = (header.inner_step, header.base_version, header.c_steps)
        self._last.move_to_end(key)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)


def _delta_parts(
    tensors: Mapping[str, torch.Tensor], codec: str, names: Sequence[str], shapes: Mapping[str, Sequence[int]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Per tensor name, its payload parts (flat), with names, dtypes and sizes checked."""
    if codec not in registry.names("upload"):
        raise PayloadError("bad_codec", f"unknown codec {codec[:20]!r}")
    part_specs = registry.get(codec).part_specs
    specs = {n: part_specs(math.prod(shapes[n])) for n in names}
    expected = {f"{n}/{part}" for n, spec in specs.items() for part in spec}
    if set(tensors) != expected:
        odd = sorted(set(tensors) ^ expected)[:3]
        raise PayloadError("wrong_shape", f"tensor names do not match the fragment (e.g. {odd})")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, spec in specs.items():
        parts = {}
        for part, (dtype, length) in spec.items():
            t = tensors[f"{name}/{part}"]
            if t.dtype != dtype:
                raise PayloadError("wrong_dtype", f"{name}/{part} is {t.dtype}, {codec} needs {dtype}")
            if t.numel() != length:
                raise PayloadError("wrong_shape", f"{name}/{part} has {t.numel()} values, expected {length}")
            parts[part] = t.reshape(-1)
        out[name] = parts
    return out


def check_delta(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    names: Sequence[str],
    shapes: Mapping[str, Sequence[int]],
    *,
    measure: bool = False,
    buf: torch.Tensor | None = None,
) -> dict[str, EncodedTensor]:
    """The delta of every tensor of the fragment, checked whole but still encoded (`ddiloco.codec.encoded`):
    what the syncer adds to a round's sums chunk by chunk. `measure`: with each tensor's norm measured,
    in the pass that checks its codes (`EncodedTensor.check`)."""
    checked = {}
    for name, parts in _delta_parts(tensors, codec, names, shapes).items():
        try:
            checked[name] = EncodedTensor.check(parts, codec, shapes[name], measure=measure, buf=buf)
        except ValueError as e:
            reason = "non_finite" if "NaN/Inf" in str(e) or "overflow" in str(e) else "malformed"
            raise PayloadError(reason, f"{name}: {e}") from None
    return checked


def decode_delta(
    tensors: Mapping[str, torch.Tensor],
    codec: str,
    names: Sequence[str],
    shapes: Mapping[str, Sequence[int]],
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The fp32 delta of every tensor of the fragment, from `{name}/{part}` payload tensors; decoded into
    `out` (per name, contiguous fp32 of the tensor's shape) when given."""
    delta: dict[str, torch.Tensor] = {}
    for name, parts in _delta_parts(tensors, codec, names, shapes).items():
        for part, t in parts.items():
            if t.is_floating_point() and not all_finite(t):
                raise PayloadError("non_finite", f"{name}/{part} has NaN/Inf")
        try:
            d = registry.get(codec).decode(parts, shapes[name], out=None if out is None else out[name])
        except ValueError as e:
            raise PayloadError("malformed", f"{name}: {e}") from None
        if not all_finite(d):  # e.g. a huge int8 scale overflowing on decode
            raise PayloadError("non_finite", f"{name} decodes to NaN/Inf")
        delta[name] = d
    return delta


def global_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(torch.linalg.vector_norm(t.double())) ** 2 for t in tensors.values()))


def clip_outliers(
    grads: Sequence[Mapping[str, torch.Tensor]], factor: float
) -> tuple[list[dict[str, torch.Tensor]], dict[int, float]]:
    """Scale every outer gradient with norm > factor × median norm down to that bound.

    Returns the (possibly scaled) gradients and {index: scale applied} for the clipped ones."""
    norms = [global_norm(g) for g in grads]
    out = [dict(g) for g in grads]
    if len(norms) < 2:
        return out, {}
    bound = factor * statistics.median(norms)
    scaled = {}
    for i, n in enumerate(norms):
        if n > bound and n > 0:
            scaled[i] = bound / n
            out[i] = {k: t * scaled[i] for k, t in grads[i].items()}
    return out, scaled


def report_ok(r: Any, lid: int) -> bool:
    """A learner report has the fields the syncer reads, with usable types (it is plain, unsigned JSON)."""
    num = (int, float)
    try:
        return (
            r["learner_id"] == lid
            and isinstance(r["incarnation"], int)
            and isinstance(r["time"], num)
            and isinstance(r["started_at"], num)
            and isinstance(r.get("step_time_ema") or 0.0, num)
            and isinstance(r.get("step_wall_ema") or 0.0, num)
            and isinstance(r.get("productive_seconds") or 0.0, num)
            and isinstance(r.get("joined_at") or 0.0, num)
            and isinstance(r.get("tokens_processed") or 0, num)
            and isinstance(r.get("loss_ema") or 0.0, num)
            and all(
                isinstance(f["discarded_tokens"], num) and isinstance(f["merged_seconds"], num)
                for f in r["fragments"].values()
            )
        )
    except (KeyError, TypeError, AttributeError):
        return False
