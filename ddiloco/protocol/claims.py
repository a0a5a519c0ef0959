"""What an update may claim: its counters bounded by the run's config and the syncer's clocks. Pure functions.

An update's signed header claims `c_steps`, `c_tokens` and `c_seconds` since its base version. Every learner
pod holds the run key, so a signature proves only that the claim comes from a learner of the run, not that
it is true; and the claims decide both the answer's merge weight (c_tokens²/c_steps = c_steps × tokens per
step², `ddiloco.merge.token_weight`) and the tokens the syncer credits towards the budget. The bounds:

- Tokens per step are exact (`bad_counters`): a learner step covers batch_for(learner) × seq_len tokens on
  each of its data-parallel ranks (`Learner._count_step` counts x.numel() × world size, and the loader
  always yields full batches), so c_tokens = c_steps × batch × seq_len × w with 1 ≤ w ≤ train.ranks.
- Steps since the base (`future_steps`): a learner counts steps from when it applied its base version,
  which it cannot have done before the version existed. The base time is when the syncer published it
  (its own wall clock, `GlobalFragment.published_at`); for the newest version of a fragment an earlier
  syncer published, the merge time its round record holds (`UpdateValidator.learn_base_times`); for any
  other (version 0, older versions after a restart) the run's start (`prepared_at` of the data meta: taken
  after version 0 was written, and learners start only once it exists). A time taken on another host's
  clock is moved `CLOCK_SKEW_S` earlier. With the allowed age = (now − base time) × (1 +
  `TIME_SLACK_FRACTION`) + `TIME_SLACK_S` (the same bound `validation.StepClock` puts on `c_seconds`), an
  answer may claim at most age / floor steps, the floor of one step being the largest of
  `MIN_STEP_SECONDS`; the model's FLOPs (6 × parameters × tokens per step) at `PEAK_FLOPS_PER_RANK` per
  rank; and the fleet's median wall seconds per step (`Roster.measured_step`, from the live learners'
  reports) divided by `FLEET_SPEEDUP`. The median is robust to a minority of lying reports.
- Steps against the learner's own cadence (`future_steps`): a claim more than `OWN_SPEEDUP` times faster
  than the fastest cadence its own incarnation reported (c_steps × cadence > OWN_SPEEDUP × allowed age) is
  rejected. The fastest reported value, not the newest, so a learner that slowed down is not caught out by
  its EMA; a learner that sped up more than 3× since it last reported is the one honest case it can reject.
- The share cap (no rejection): an answer's merge weight is capped at what `SHARE_SPEEDUP` median
  learners at the run's largest batch could have earned on the base: max_tokens = SHARE_SPEEDUP ×
  max(H, age / median cadence) × max tokens per step, and weight ≤ max_tokens × its own tokens per step
  (H = `diloco.sync_every`: a round opens about H median steps after its fragment's last version, and until
  the fleet reported a cadence H is all there is). An honest learner makes at most age / its own cadence
  steps, so the cap only touches one that made more than 2H steps at more than `SHARE_SPEEDUP`× the
  median's token rate over the base's whole age; it keeps its credit and only its say in the direction is
  capped (token weighting off: every weight is 1, no cap). A liar inside the step bounds weighs at most as
  much as `SHARE_SPEEDUP` median learners.

Why these factors: `FLEET_SPEEDUP` = 8 covers mixed hardware and batch sizes in one run (a learner stepping
8× the median's rate over the whole life of its base); beyond it a claim is implausible and rejected.
`OWN_SPEEDUP` = 3 leaves room for a learner's EMA to lag a real speed-up. `SHARE_SPEEDUP` = 2 keeps a liar
to 2/(2 + M − 1) of a round's weight against M − 1 honest median answers.

What stays open: a liar inside the bounds is still credited what it claims (up to `FLEET_SPEEDUP`× an
honest answer's tokens: the learner's books credit the whole answer, so the syncer cannot credit part of
it and keep the ledger balanced); before any learner reported a cadence only the 10 µs floor bounds steps
(against the base's age); after a syncer restart, bases older than their fragment's newest version are
bounded from the run's start.
"""

from __future__ import annotations

from collections.abc import Mapping
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
FLEET_SPEEDUP = 8.0
OWN_SPEEDUP = 3.0
SHARE_SPEEDUP = 2.0


@dataclass(frozen=True, slots=True)
class Pace:
    """The learners' cadences as the syncer last read them (a snapshot, shared with reader threads):
    `fleet`: median wall seconds per step of the live learners (None until one reported); `own`:
    contributor -> the fastest cadence that incarnation reported."""

    fleet: float | None = None
    own: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Limits:
    """The run's constants behind the bounds: tokens per step of one rank by learner (`batch_for` ×
    seq_len), the most ranks, the largest tokens per step, the FLOPs floor of one step, and H."""

    seq_len: int
    batch_sizes: tuple[int, ...]
    default_batch: int
    ranks: int
    params: int
    sync_every: int

    def per_rank(self, learner_id: int) -> int:
        b = self.batch_sizes[learner_id] if learner_id < len(self.batch_sizes) else self.default_batch
        return b * self.seq_len

    @property
    def max_tokens_per_step(self) -> int:
        return max([self.default_batch, *self.batch_sizes]) * self.seq_len * self.ranks

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
    """`c_steps` fit in `age` allowed seconds on the base (`future_steps` otherwise); `who`: its sender."""
    n, base = header.c_steps, header.base_version
    floor = max(MIN_STEP_SECONDS, limits.flops_floor(tps))
    if pace.fleet is not None:
        floor = max(floor, pace.fleet / FLEET_SPEEDUP)
    if n * floor > age:
        raise PayloadError(
            "future_steps",
            f"{n} steps on base version {base} in {age:.1f}s allowed: at most {age / floor:.0f} at "
            f"{floor * 1e3:.3g} ms a step (the fleet's median / {FLEET_SPEEDUP:g}, or the model's FLOPs)",
        )
    own = pace.own.get(who)
    if own is not None and n * own > OWN_SPEEDUP * age:
        raise PayloadError(
            "future_steps",
            f"{n} steps in {age:.1f}s is more than {OWN_SPEEDUP:g}× its own reported cadence "
            f"({own * 1e3:.3g} ms a step)",
        )


def max_weight(*, age: float, tps: int, limits: Limits, pace: Pace) -> float:
    """The share cap on a token weight (module docstring): SHARE_SPEEDUP × the steps of a median learner
    (H, or as many as it makes in `age` when more) at the largest batch, × this answer's tokens per step."""
    steps = float(limits.sync_every)
    if pace.fleet is not None and pace.fleet > 0:
        steps = max(steps, age / pace.fleet)
    return SHARE_SPEEDUP * steps * limits.max_tokens_per_step * tps
