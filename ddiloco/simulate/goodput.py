"""Goodput of data-parallel, elastic data-parallel and Decoupled DiLoCo under chip failures (seeded DES).

Goodput is useful chip-time / allocated chip-time; uptime is the fraction of wall time during which the job
(any learner, for Decoupled DiLoCo) is training. The failure domain is a slice, simulated as alternating up
and repair periods, which is exact and costs O(failures), not O(chips). Data-parallel stops on every
failure until repair and restart; elastic data-parallel pauses for a reconfiguration and goes on with the
healthy slices; Decoupled DiLoCo with M learners is M independent elastic jobs, since the syncer never
blocks. All three share the parameters `calibrate` fits to the paper's two data-parallel rows; the learner
rows are predictions, on the same hardware timeline (common random numbers).

The model, each choice where the paper is silent, and the calibration: docs/simulate.md, "Goodput model".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

import numpy as np

logger = logging.getLogger(__name__)

YEAR_SECONDS = 365.25 * 86400.0
PAPER_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
# Paper's goodput table (%, per-chip MTBF 1 year); key: (method, learners).
PAPER_GOODPUT: dict[tuple[str, int], tuple[float, ...]] = {
    ("dp", 1): (72, 57, 38, 27, 18),
    ("elastic_dp", 1): (88, 80, 69, 58, 40),
    ("decoupled", 2): (94, 88, 80, 70, 54),
    ("decoupled", 4): (96, 93, 89, 82, 73),
    ("decoupled", 8): (98, 96, 94, 88, 80),
    ("decoupled", 16): (99, 98, 96, 93, 86),
}
METHODS = ("dp", "elastic_dp", "decoupled")


def paper_goodput(method: str, learners: int, chips: int) -> float | None:
    """The paper's goodput (a fraction) for this cell, or None when the paper has no such cell."""
    row = PAPER_GOODPUT.get((method, 1 if method != "decoupled" else learners))
    if row is None or chips not in PAPER_CHIPS:
        return None
    return row[PAPER_CHIPS.index(chips)] / 100.0


@dataclass(frozen=True, slots=True)
class Distribution:
    """A non-negative duration distribution: `const:S`, `exp:MEAN`, `lognormal:MEDIAN,SIGMA`, `uniform:LO,HI`."""

    kind: str
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("const", "exp", "lognormal", "uniform"):
            raise ValueError(f"unknown distribution {self.kind!r}: use const, exp, lognormal or uniform")
        if self.a < 0 or self.b < 0 or not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise ValueError(f"distribution {self.spec()} needs finite, non-negative parameters")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform:LO,HI needs LO <= HI, got {self.spec()}")

    @classmethod
    def parse(cls, spec: str) -> Distribution:
        kind, _, args = spec.partition(":")
        try:
            values = [float(x) for x in args.split(",")] if args else []
        except ValueError:
            raise ValueError(f"bad distribution {spec!r}: numbers expected after ':'") from None
        arity = {"const": 1, "exp": 1, "lognormal": 2, "uniform": 2}.get(kind)
        if arity is None or len(values) != arity:
            raise ValueError(
                f"bad distribution {spec!r}: use const:SECONDS, exp:MEAN, lognormal:MEDIAN,SIGMA or uniform:LO,HI"
            )
        return cls(kind, *values)

    @classmethod
    def const(cls, seconds: float) -> Distribution:
        return cls("const", float(seconds))

    def spec(self) -> str:
        return f"{self.kind}:{self.a:g}" + (f",{self.b:g}" if self.kind in ("lognormal", "uniform") else "")

    @property
    def mean(self) -> float:
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        return self.a

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "const":
            return np.full(n, self.a)
        if self.kind == "exp":
            return rng.exponential(self.a, n) if self.a > 0 else np.zeros(n)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        return self.a * np.exp(self.b * rng.standard_normal(n))


@dataclass(kw_only=True, slots=True)
class FailureModel:
    """Failure and recovery parameters shared by every training method. Defaults: calibrated (see docs)."""

    mtbf_years: float = 1.0
    """Per-chip mean time between failures, years."""
    slice_chips: int = 9375
    """Chips per slice (failure domain). Default: the smallest learner of the paper's grid, 150k / 16."""
    repair: Distribution = field(default_factory=lambda: Distribution.const(78.5))
    """Time a failed slice is out of service (repair or swap-in of a spare), seconds."""
    restart: Distribution = field(default_factory=lambda: Distribution.const(0.0))
    """Data-parallel only: extra time to restart the job once the slice is back, seconds."""
    reconfig: Distribution = field(default_factory=lambda: Distribution.const(20.25))
    """Elastic jobs only: pause of the whole job to drop a failed slice, seconds."""
    step_seconds: float = 0.0
    """Inner-step time; a failure also loses the interrupted step (uniform in [0, step]). 0: folded in above."""

    def __post_init__(self) -> None:
        if not self.mtbf_years > 0:
            raise ValueError(f"mtbf_years must be > 0, got {self.mtbf_years}")
        if self.slice_chips < 1:
            raise ValueError(f"slice_chips must be >= 1, got {self.slice_chips}")
        if self.step_seconds < 0:
            raise ValueError(f"step_seconds must be >= 0, got {self.step_seconds}")

    @property
    def chip_rate(self) -> float:
        """Failures per chip-second."""
        return 1.0 / (self.mtbf_years * YEAR_SECONDS)

    def to_dict(self) -> dict[str, object]:
        return {
            "mtbf_years": self.mtbf_years,
            "slice_chips": self.slice_chips,
            "repair": self.repair.spec(),
            "restart": self.restart.spec(),
            "reconfig": self.reconfig.spec(),
            "step_seconds": self.step_seconds,
        }


@dataclass(frozen=True, slots=True)
class GoodputRow:
    method: str
    learners: int
    chips: int
    goodput: float
    uptime: float
    failures: int
    paper: float | None

    def to_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "learners": self.learners,
            "chips": self.chips,
            "goodput": round(self.goodput, 4),
            "uptime": round(self.uptime, 4),
            "failures": self.failures,
            "paper": self.paper,
        }


# ---------------------------------------------------------------------------------------------------------
# closed forms (exact for data-parallel, first order for elastic jobs); used by `calibrate` and the tests


def closed_form(method: str, chips: int, learners: int, model: FailureModel) -> float:
    """Expected goodput. DP: renewal reward, 1 / (1 + Λ·E[outage]). Elastic job of n chips:
    (1 - f) / (1 + n·λ·(1 - f)·E[pause]) with f = λS·E[R] / (1 + λS·E[R]) the fraction of slices down."""
    lam = model.chip_rate
    lost_step = model.step_seconds / 2
    if method == "dp":
        return 1.0 / (1.0 + chips * lam * (model.repair.mean + model.restart.mean + lost_step))
    n = chips if method == "elastic_dp" else chips / learners
    x = lam * model.slice_chips * model.repair.mean
    f = x / (1.0 + x)
    return (1.0 - f) / (1.0 + n * lam * (1.0 - f) * (model.reconfig.mean + lost_step))


@dataclass(frozen=True, slots=True)
class Calibration:
    repair_seconds: float
    restart_seconds: float
    reconfig_seconds: float
    rms_points: float
    """Root-mean-square error over the fitted cells, goodput points."""

    def apply(self, model: FailureModel) -> FailureModel:
        return FailureModel(
            mtbf_years=model.mtbf_years,
            slice_chips=model.slice_chips,
            repair=Distribution.const(self.repair_seconds),
            restart=Distribution.const(self.restart_seconds),
            reconfig=Distribution.const(self.reconfig_seconds),
            step_seconds=model.step_seconds,
        )


def calibrate(
    chips: tuple[int, ...] | list[int],
    dp: tuple[float, ...] | list[float],
    elastic_dp: tuple[float, ...] | list[float],
    *,
    mtbf_years: float = 1.0,
    slice_chips: int = 9375,
) -> Calibration:
    """Least-squares fit of (repair, restart, reconfig) to data-parallel and elastic-DP goodputs (fractions).

    Only these two rows are used, so every Decoupled DiLoCo number that comes out is a prediction. DP pins
    D = repair + restart; elastic DP pins the pause and the repair (through the fraction of slices down);
    restart >= 0 ties the two: a repair can't take longer than the whole DP outage.
    """
    n = np.asarray(chips, dtype=float)
    lam = 1.0 / (mtbf_years * YEAR_SECONDS)
    y_dp, y_el = np.asarray(dp, dtype=float), np.asarray(elastic_dp, dtype=float)
    grid = np.arange(0.0, 300.0, 0.25)  # seconds, for D and R
    err_dp = ((1.0 / (1.0 + np.outer(grid, n) * lam) - y_dp) ** 2).sum(axis=1)  # [D]
    pauses = np.arange(0.0, 60.0, 0.05)
    x = lam * slice_chips * grid
    f = (x / (1.0 + x))[:, None, None]  # [R, 1, 1]
    g_el = (1.0 - f) / (1.0 + n[None, None, :] * lam * (1.0 - f) * pauses[None, :, None])  # [R, P, chips]
    err_el_rp = ((g_el - y_el) ** 2).sum(axis=2)
    best_p = err_el_rp.argmin(axis=1)
    err_el = err_el_rp[np.arange(grid.size), best_p]  # [R]
    # D >= R: best D at or above each R is a suffix minimum over the D grid.
    suffix_arg = np.empty(grid.size, dtype=int)
    best = grid.size - 1
    for i in range(grid.size - 1, -1, -1):
        if err_dp[i] <= err_dp[best]:
            best = i
        suffix_arg[i] = best
    total = err_el + err_dp[suffix_arg]
    r = int(total.argmin())
    d = grid[suffix_arg[r]]
    rms = 100.0 * math.sqrt(total[r] / (2 * n.size))
    return Calibration(
        repair_seconds=float(grid[r]),
        restart_seconds=float(d - grid[r]),
        reconfig_seconds=float(pauses[best_p[r]]),
        rms_points=rms,
    )


# ---------------------------------------------------------------------------------------------------------
# discrete-event simulation


def slice_outages(
    n_slices: int, model: FailureModel, horizon: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every slice outage that starts before `horizon`: (fail_time, back_time, slice_id), unsorted."""
    rate = model.chip_rate * model.slice_chips
    t = np.zeros(n_slices)
    active = np.arange(n_slices)
    fails, backs, ids = [], [], []
    while active.size:  # one up/down cycle of every still-running slice per pass
        f = t[active] + rng.exponential(1.0 / rate, active.size)
        keep = f < horizon
        active, f = active[keep], f[keep]
        b = f + model.repair.sample(rng, f.size)
        fails.append(f)
        backs.append(b)
        ids.append(active)
        t[active] = b
    return np.concatenate(fails), np.concatenate(backs), np.concatenate(ids)


def _pause_starts(t: np.ndarray, pause: np.ndarray) -> np.ndarray:
    """Indices of failures (sorted times `t`) that start a pause; the others fall inside an ongoing one."""
    nxt = np.searchsorted(t, t + pause, side="right").tolist()
    starts, i, n = [], 0, t.size
    while i < n:
        starts.append(i)
        i = nxt[i]
    return np.asarray(starts, dtype=np.int64)


def _union(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint, sorted union of intervals [starts, ends)."""
    if starts.size == 0:
        return starts, ends
    o = np.argsort(starts, kind="stable")
    s, e = starts[o], ends[o]
    reach = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.maximum.reduceat(e, idx)


def _measure_all_covered(intervals: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """Length of time covered by every one of the given sets of disjoint intervals at once."""
    k = len(intervals)
    times = np.concatenate([x for s, e in intervals for x in (s, e)])
    deltas = np.concatenate([x for s, e in intervals for x in (np.ones(s.size), -np.ones(e.size))])
    if times.size == 0:
        return 0.0
    o = np.lexsort((deltas, times))  # at equal times, close (-1) before open (+1)
    times, count = times[o], np.cumsum(deltas[o])
    return float(np.diff(times)[count[:-1] == k].sum())


@dataclass(frozen=True, slots=True)
class JobResult:
    useful_slice_seconds: float
    downtime: tuple[np.ndarray, np.ndarray]
    """Disjoint intervals during which the job does not train (paused, or every slice down)."""
    failures: int


def simulate_elastic_job(
    n_slices: int,
    fail: np.ndarray,
    back: np.ndarray,
    model: FailureModel,
    horizon: float,
    rng: np.random.Generator,
) -> JobResult:
    """One elastic job over `n_slices` slices whose outages are (fail, back), fail sorted ascending."""
    back = np.minimum(back, horizon)
    pause = model.reconfig.sample(rng, fail.size)
    if model.step_seconds > 0:
        pause = pause + rng.uniform(0.0, model.step_seconds, fail.size)
    k = _pause_starts(fail, pause)
    p0, p1 = fail[k], np.minimum(fail[k] + pause[k], horizon)
    # ∫ slices down dt from 0 to q, for the overlap of outages with pauses (those chips were idle anyway).
    fail_cum = np.concatenate(([0.0], np.cumsum(fail)))
    back_sorted = np.sort(back)
    back_cum = np.concatenate(([0.0], np.cumsum(back_sorted)))

    def down_integral(q: np.ndarray) -> np.ndarray:
        i = np.searchsorted(fail, q, side="right")
        j = np.searchsorted(back_sorted, q, side="right")
        return (i * q - fail_cum[i]) - (j * q - back_cum[j])

    healthy = n_slices * horizon - float((back - fail).sum())
    paused_healthy = n_slices * float((p1 - p0).sum()) - float((down_integral(p1) - down_integral(p0)).sum())
    # Stretches with every slice down: sweep the outages, keep segments where the down count is n_slices.
    times = np.concatenate((fail, back))
    deltas = np.concatenate((np.ones(fail.size), -np.ones(back.size)))
    o = np.lexsort((deltas, times))
    times, count = times[o], np.cumsum(deltas[o])
    all_down = np.flatnonzero(count[:-1] >= n_slices)
    down = _union(np.concatenate((p0, times[all_down])), np.concatenate((p1, times[all_down + 1])))
    return JobResult(healthy - paused_healthy, down, int(fail.size))


def simulate_dp(chips: int, model: FailureModel, horizon: float, rng: np.random.Generator) -> GoodputRow:
    """Data-parallel: up (exponential, rate chips·λ), then repair + restart; a renewal process."""
    rate = chips * model.chip_rate
    useful, t, failures = 0.0, 0.0, 0
    batch = int(horizon * rate * 1.1) + 64
    while t < horizon:
        up = rng.exponential(1.0 / rate, batch)
        out = model.repair.sample(rng, batch) + model.restart.sample(rng, batch)
        if model.step_seconds > 0:
            out = out + rng.uniform(0.0, model.step_seconds, batch)
        start = t + np.concatenate(([0.0], np.cumsum(up + out)[:-1]))
        live = start < horizon
        useful += float((np.minimum(start + up, horizon) - start)[live].sum())
        failures += int((start + up < horizon)[live].sum())
        t = float(start[-1] + up[-1] + out[-1])
    g = useful / horizon
    return GoodputRow("dp", 1, chips, g, g, failures, paper_goodput("dp", 1, chips))


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *key]))


def simulate_chips(
    chips: int,
    learners: list[int] | tuple[int, ...],
    model: FailureModel,
    horizon: float,
    seed: int = 0,
) -> list[GoodputRow]:
    """DP, elastic DP and Decoupled DiLoCo for each M in `learners`, all at one chip count."""
    n_slices = max(1, round(chips / model.slice_chips))
    if n_slices * model.slice_chips != chips:
        logger.warning(
            "%d chips is not a whole number of %d-chip slices: simulating %d slices",
            chips,
            model.slice_chips,
            n_slices,
        )
    for m in learners:
        if not 1 <= m <= n_slices:
            raise ValueError(
                f"{m} learners need at least one {model.slice_chips}-chip slice each; "
                f"{chips} chips hold {n_slices} (lower --slice-chips or the learner count)"
            )
    on_paper = model.mtbf_years == 1.0  # the paper's cells only make sense at its MTBF
    dp = simulate_dp(chips, model, horizon, _rng(seed, chips, 0))
    rows = [dp if on_paper else replace(dp, paper=None)]
    fail, back, sid = slice_outages(n_slices, model, horizon, _rng(seed, chips, 1))
    for m in dict.fromkeys((1, *learners)):  # elastic DP is the one-learner case
        owner = np.arange(n_slices) * m // n_slices  # learner of each slice, contiguous blocks
        job = owner[sid]
        o = np.lexsort((fail, job))
        bounds = np.searchsorted(job[o], np.arange(m + 1))
        sizes = np.bincount(owner, minlength=m)
        rng = _rng(seed, chips, 2, m)
        useful, downs, failures = 0.0, [], 0
        for j in range(m):
            sel = o[bounds[j] : bounds[j + 1]]
            r = simulate_elastic_job(int(sizes[j]), fail[sel], back[sel], model, horizon, rng)
            useful += r.useful_slice_seconds
            downs.append(r.downtime)
            failures += r.failures
        uptime = 1.0 - _measure_all_covered(downs) / horizon
        goodput = useful / (n_slices * horizon)
        for method in ("elastic_dp",) * (m == 1) + ("decoupled",) * (m in learners):
            paper = paper_goodput(method, m, chips) if on_paper else None
            rows.append(GoodputRow(method, m, chips, goodput, uptime, failures, paper))
    return rows


def simulate_grid(
    chips: list[int] | tuple[int, ...],
    learners: list[int] | tuple[int, ...],
    model: FailureModel,
    horizon: float,
    seed: int = 0,
) -> list[GoodputRow]:
    """Every (chips, method, M) cell. Seeded: the same arguments give the same rows."""
    if horizon <= 0:
        raise ValueError(f"horizon must be > 0 seconds, got {horizon}")
    rows: list[GoodputRow] = []
    for n in chips:
        rows.extend(simulate_chips(int(n), list(learners), model, horizon, seed))
    return rows
