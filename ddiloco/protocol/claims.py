"""What an update may claim: its counters bounded by evidence the syncer holds, not by what other learners
claim. Pure functions and one small book (`Coverage`).

An update's signed header claims `c_steps`, `c_tokens` and `c_seconds` since its base version, and the
incarnation's `inner_step`. Every learner pod holds the learner key, so the syncer bounds each claim:
tokens per step are exact (`bad_counters`); steps must fit in the time since the later of the base's
publication and the incarnation's first report, on the syncer's monotonic clock, within the model's FLOPs
floor and `OWN_SPEEDUP` × the incarnation's own cadence (`future_steps`, `steps`); and each inner step is
credited once per fragment (`overlap`, `Coverage`). No bound refers to other learners.

Design notes (the bounds in detail, what stays open): docs/internals.md, "What an update may claim", and
the threat model in docs/operations.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.validation import MIN_STEP_SECONDS, TIME_SLACK_FRACTION, TIME_SLACK_S
from ddiloco.protocol.wire import PayloadError

CLOCK_SKEW_S = 10.0
"""Allowed difference between the syncer's wall clock and the host that prepared the run (hosts of one
cluster keep NTP time, well within it). An honest answer refused for a larger skew is not lost: its tokens
stay outstanding, and the 5% slack admits the next answer once the base is 20 × the excess old."""
PEAK_FLOPS_PER_RANK = 1e16
"""FLOP/s no single accelerator reaches (about 4× a B200's dense bf16 peak): the config's physical floor."""
OWN_SPEEDUP = 3.0
"""A claim may be this many times faster than the fastest cadence the incarnation reported (room for its
EMA to lag a real speed-up)."""
HEARD_SLACK_S = 10.0
"""How much earlier than the syncer first read an incarnation's report it may have joined (reports are
read every half second; one is written at the join, before any answer)."""


@dataclass(frozen=True, slots=True)
class Pace:
    """The learners' cadences as the syncer last read them (a snapshot, shared with reader threads):
    `own`: contributor -> the fastest cadence that incarnation reported; `heard`: contributor -> the syncer's
    steady time when it first read a report of that incarnation."""

    own: Mapping[str, float] = field(default_factory=dict)
    heard: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Limits:
    """The run's constants behind the bounds: tokens per step of one rank by learner (`batch_for` ×
    seq_len), the most ranks and the FLOPs floor of one step."""

    seq_len: int
    batch_sizes: tuple[int, ...]
    default_batch: int
    ranks: int
    params: int

    def per_rank(self, learner_id: int) -> int:
        b = self.batch_sizes[learner_id] if learner_id < len(self.batch_sizes) else self.default_batch
        return b * self.seq_len

    def flops_floor(self, tokens_per_step: int) -> float:
        """Seconds a step of `tokens_per_step` tokens needs at least, on as many ranks as it may have."""
        return 6.0 * self.params * tokens_per_step / (PEAK_FLOPS_PER_RANK * self.ranks)


def tokens_per_step(header: UpdateHeader, limits: Limits) -> int:
    """The answer's tokens per step, checked exact (`bad_counters` otherwise)."""
    steps, tokens = header.c_steps, header.c_tokens
    unit = limits.per_rank(header.learner_id)
    ranks, rest = divmod(tokens, steps * unit) if steps >= 1 else (0, 1)
    if rest or not 1 <= ranks <= limits.ranks:
        raise PayloadError(
            "bad_counters",
            f"c_tokens={tokens} over c_steps={steps} is not {unit} tokens per step per rank on 1.."
            f"{limits.ranks} ranks (train.batch_size/learner_batch_sizes × model.seq_len × train.ranks)",
        )
    return ranks * unit


def allowed_age(now: float, base_time: float) -> float:
    """Seconds an answer may have trained on a base known since `base_time` (the rule `StepClock.check`
    applies to `c_seconds`)."""
    return max(0.0, now - base_time) * (1 + TIME_SLACK_FRACTION) + TIME_SLACK_S


def steps(header: UpdateHeader, *, age: float, tps: int, limits: Limits, pace: Pace, who: str) -> None:
    """`c_steps` fit in `age` allowed seconds (`future_steps` otherwise); `who`: its sender."""
    n, base = header.c_steps, header.base_version
    floor = max(MIN_STEP_SECONDS, limits.flops_floor(tps))
    if n * floor > age:
        raise PayloadError(
            "future_steps",
            f"{n} steps on base version {base} in {age:.1f}s allowed: at most {age / floor:.0f} at "
            f"{floor * 1e3:.3g} ms a step (the model's FLOPs at the fastest device there is)",
        )
    own = pace.own.get(who)
    if own is not None and n * own > OWN_SPEEDUP * age:
        raise PayloadError(
            "future_steps",
            f"{n} steps in {age:.1f}s is more than {OWN_SPEEDUP:g}× its own reported cadence "
            f"({own * 1e3:.3g} ms a step)",
        )


def since(base_time: float, who: str, pace: Pace, now: float) -> float:
    """When the answer's steps can have begun at the earliest: its base's time, or when the syncer first
    heard of the incarnation (less `HEARD_SLACK_S`) if later; an incarnation never heard of: now."""
    heard = pace.heard.get(who, now)
    return max(base_time, heard - HEARD_SLACK_S)


class Coverage:
    """Which inner steps of each incarnation were merged, per fragment, and its answers in open rounds
    (module docstring). The merged ends are saved in the syncer's state (`state_dict`); the open rounds'
    answers are read again by a restarted syncer."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self.merged: OrderedDict[tuple[str, int], int] = OrderedDict()
        """(contributor, fragment) -> the end of the last merged range (an inner step)."""
        self.pending: dict[tuple[str, int], tuple[int, int]] = {}
        """(contributor, fragment) -> (round, end of its range) of its answer in an open round."""

    def state_dict(self) -> dict[str, int]:
        """The merged ends as the syncer state keeps them: "<contributor>/<fragment>" -> inner step."""
        return {f"{who}/{p}": end for (who, p), end in self.merged.items()}

    def load_state_dict(self, saved: Mapping[str, int]) -> None:
        self.merged = OrderedDict()
        for name, end in saved.items():
            who, _, p = name.rpartition("/")
            if who and p.isdigit() and isinstance(end, int):
                self.merged[(who, int(p))] = end

    def check(self, who: str, header: UpdateHeader) -> None:
        p, start = header.fragment_id, header.inner_step - header.c_steps
        end = self.merged.get((who, p))
        if end is not None and start < end:
            raise PayloadError(
                "overlap",
                f"steps {start}..{header.inner_step} of fragment {p} reach below step {end}, where its "
                "last merged answer ended (each step is credited once)",
            )
        held = self.pending.get((who, p))
        if held is not None and held[0] != header.round:
            raise PayloadError(
                "overlap", f"it has an answer in round {held[0]} of fragment {p} still open (one at a time)"
            )

    def accepted(self, who: str, header: UpdateHeader) -> None:
        self.pending[(who, header.fragment_id)] = (header.round, header.inner_step)

    def closed(self, round_: int, p: int, merged: Iterable[str]) -> None:
        """Round `round_` of fragment p closed; `merged`: the contributors it merged (none if abandoned)."""
        for who in merged:
            held = self.pending.get((who, p))
            if held is not None and held[0] == round_:
                self.merged[(who, p)] = max(self.merged.get((who, p), 0), held[1])
                self.merged.move_to_end((who, p))
        for key in [k for k, (r, _) in self.pending.items() if r == round_ and k[1] == p]:
            del self.pending[key]
        while len(self.merged) > self.capacity:
            self.merged.popitem(last=False)
