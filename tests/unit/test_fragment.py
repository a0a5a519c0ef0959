"""`GlobalFragment.propose`/`commit` driven directly: the fp32 master under bf16 publication (issue 16 item 4)
and answers built on an older version (issue 17 item 5).

The learners here are simulated the way `ddiloco.learner` behaves: a learner trains from the values it
*received* (the published version of its base, bf16-rounded when `global_dtype` is bf16) and uploads its
fp32 parameters minus those values as its delta.
"""

import pytest
import torch

from ddiloco.protocol.messages import Ledger
from ddiloco.protocol.update import UpdateHeader
from ddiloco.syncer.fragment import GlobalFragment, MergeRule
from ddiloco.syncer.rounds import Answer, Round

GAIN = "h.0.ln_1.weight"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def rule(**kw) -> MergeRule:
    settings = dict(
        method="rda",
        outer_lr=0.7,
        outer_momentum=0.9,
        token_weighting=True,
        robust_clip=None,
        embedding_names=frozenset(),
    )
    return MergeRule(**{**settings, **kw})


class Run:
    """One fragment plus the store's copy of every version it published (what `read` would verify)."""

    def __init__(self, theta: dict[str, torch.Tensor], dtype: str, r: MergeRule) -> None:
        self.dtype, self.rule = dtype, r
        if dtype == "bf16":  # `prepare` publishes version 0 rounded, and the syncer starts from it
            theta = {n: t.to(torch.bfloat16).float() for n, t in theta.items()}
        self.store = {0: {n: t.clone() for n, t in theta.items()}}
        self.frag = GlobalFragment(0, 0, theta, r.optimizer(), Ledger(), read=lambda v: self.store[v])

    def received(self, version: int) -> dict[str, torch.Tensor]:
        """What a learner holds after downloading `version` (fp32 tensors of the published payload)."""
        return {n: t.clone() for n, t in self.store[version].items()}

    def answer(self, name: str, base: int, step: dict[str, torch.Tensor] | float) -> Answer:
        """Learner `name` trained from version `base` and moved its parameters by `step`; its delta is
        taken against the values it received, in fp32, as `LearnerExchange._delta` does."""
        got = self.received(base)
        moved = {
            n: t + (step if isinstance(step, float) else step[n]) for n, t in got.items()
        }  # the learner's θ_m
        delta = {n: moved[n] - got[n] for n in got}
        header = UpdateHeader(base_version=base, c_tokens=640, c_steps=10, c_seconds=1.0)
        return Answer(name, header, delta)

    def merge(self, answers: list[Answer]) -> None:
        proposal = self.frag.propose({a.contributor: a for a in answers}, self.rule)
        v = proposal.version
        cast = torch.bfloat16 if self.dtype == "bf16" else torch.float32
        # what `publish_global` writes and `read_global` gives back
        self.store[v] = {n: t.to(cast).float() for n, t in proposal.theta.items()}
        self.frag.commit(proposal, published_at=float(v), clock=float(v))

    @property
    def published(self) -> dict[str, torch.Tensor]:
        return self.store[self.frag.version]


def raise_gain(dtype: str, rounds: int = 40) -> Run:
    """Four learners each raise a LayerNorm gain (1.0 at init) by 3e-4 per round."""
    run = Run({GAIN: torch.ones(16)}, dtype, rule())
    for _ in range(rounds):
        v = run.frag.version
        run.merge([run.answer(f"{m}-0", v, 3e-4) for m in range(4)])
    return run


def test_bf16_publication_keeps_an_fp32_master_so_small_updates_accumulate():
    """Issue 16 item 4. Measured (outer lr 0.7, momentum 0.9, RDA, 40 rounds of +3e-4 from four learners):
    fp32 globals reach 1.0672; with bf16 globals the old `commit` rounded the syncer's own Θ to bf16 after
    every step, and each step (≤ 2.1e-3) is below half a bf16 ulp at 1.0 (3.9e-3), so the gain stayed at
    exactly 1.0 for all 40 rounds (master and published). Now the master follows the fp32 run and the
    published value is the master rounded once: 1.0703125."""
    ref = raise_gain("fp32")
    run = raise_gain("bf16")
    gain_fp32 = float(ref.frag.theta[GAIN][0])
    assert 1.06 < gain_fp32 < 1.075
    master = run.frag.theta[GAIN]
    assert master.dtype == torch.float32
    # Same trajectory as with fp32 globals, up to the fp32 rounding of the learners' deltas
    torch.testing.assert_close(master, ref.frag.theta[GAIN], rtol=0, atol=1e-5)
    published = run.published[GAIN]
    assert torch.equal(published, master.to(torch.bfloat16).float())
    assert float(published[0]) > 1.06  # it moved: 1.0703125
    # What the fragment offers as the base of version v is what learners received, not the master
    assert torch.equal(run.frag.base(run.frag.version)[GAIN], published)


def test_fp32_globals_are_unchanged_by_the_master():
    """With fp32 globals the master is what is published, bit for bit."""
    run = raise_gain("fp32", rounds=5)
    assert torch.equal(run.frag.theta[GAIN], run.published[GAIN])


def climbed(r: MergeRule, rounds: int = 5) -> Run:
    """Five rounds in which four learners each raise every value by 1e-3 (fp32 globals)."""
    run = Run({GAIN: torch.ones(16)}, "fp32", r)
    for _ in range(rounds):
        v = run.frag.version
        run.merge([run.answer(f"{m}-0", v, 1e-3) for m in range(4)])
    return run


def moved(run: Run, answers) -> float:
    before = float(run.frag.theta[GAIN][0])
    run.merge(answers(run, run.frag.version))
    return float(run.frag.theta[GAIN][0]) - before


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_a_stale_learner_without_progress_does_not_pull_the_model_back(momentum: float):
    """Issue 17 item 5. After five rounds of progress, the only answer of a round comes from a learner that
    made no progress (δ = 0) on a base 3 versions old. Its outer gradient is its own progress, 0, so Θ moves
    exactly as it does when a zero-progress learner answers on the current version: by momentum alone.
    Measured with the old Δ_m = Θ_current − (Θ_base + δ_m), which charges the learner with undoing every
    outer step since its base: Θ moved by −9.06e-3 with momentum 0.9 (+2.32e-3 for a fresh zero answer),
    and by −1.47e-3 without momentum (0 for a fresh zero answer), i.e. back by 2.1× the last outer step
    (7.0e-4)."""
    r = rule(outer_momentum=momentum)
    fresh = moved(climbed(r), lambda run, v: [run.answer("9-0", v, 0.0)])
    stale = moved(climbed(r), lambda run, v: [run.answer("9-0", v - 3, 0.0)])
    assert fresh >= 0.0
    assert stale >= 0.0
    # the staleness rule may damp the step (a lone stale answer's step shrinks), never reverse it
    assert stale <= fresh + 1e-9


def test_a_stale_zero_progress_learner_among_fresh_ones_only_dilutes_the_step():
    """Issue 17 item 5, with the plain mean and no momentum so the arithmetic is readable: three learners
    raise every value by 1e-3 from the current version, a fourth made no progress on a base 3 versions
    old. Measured with the old outer gradient: Θ moved by 1.57e-4 instead of 7.0e-4 (the three alone),
    i.e. the stale answer undid 78% of the round; under RDA its opposite-pointing Δ even lengthened the
    step (8.9e-4). Now the stale answer's Δ is 0: it dilutes the mean at most as much as a fresh
    zero-progress answer (5.25e-4), and less when its staleness lowers its weight."""
    r = rule(method="mean", outer_momentum=0.0)
    three = moved(climbed(r), lambda run, v: [run.answer(f"{m}-0", v, 1e-3) for m in range(3)])
    with_fresh_zero = moved(
        climbed(r),
        lambda run, v: [run.answer(f"{m}-0", v, 1e-3) for m in range(3)] + [run.answer("9-0", v, 0.0)],
    )
    with_stale_zero = moved(
        climbed(r),
        lambda run, v: [run.answer(f"{m}-0", v, 1e-3) for m in range(3)] + [run.answer("9-0", v - 3, 0.0)],
    )
    assert three == pytest.approx(7e-4, rel=1e-3)
    assert with_fresh_zero == pytest.approx(0.75 * three, rel=1e-3)
    assert with_fresh_zero - 1e-9 <= with_stale_zero <= three + 1e-9


def rda64(deltas: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The paper's RDA formula, literally, in float64."""
    w = torch.tensor(weights, dtype=torch.float64)
    radius = sum(wi * d.norm() for wi, d in zip(w, deltas, strict=True)) / w.sum()
    direction = sum(wi * d / d.norm() for wi, d in zip(w, deltas, strict=True)) / w.sum()
    return radius * direction / direction.norm()


@pytest.mark.parametrize("bases", [(5, 4, 2), (4, 4, 1)])
def test_propose_matches_a_float64_reference_of_the_staleness_rule(bases):
    """One merge at version 5 against an independent float64 reference: Δ_m = −δ_m; weights
    c_tokens²/c_steps × (1 + s_m)^-1/2; RDA for the block, the weighted mean for the embedding; the merged
    gradient scaled by the freshest answer's discount (1 with a fresh answer, 1/√2 when the freshest is one
    version behind); then the first Nesterov step θ − lr·(1 + m)·g."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"wte.weight": (6, 4), GAIN: (16,)}
    theta = {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}
    r = rule(embedding_names=frozenset({"wte.weight"}))
    frag = GlobalFragment(0, 5, theta, r.optimizer(), Ledger(), read=lambda v: theta)
    counters = [(640, 10), (300, 3), (1000, 40)]
    answers = {}
    for m, (base, (tokens, steps)) in enumerate(zip(bases, counters, strict=True)):
        delta = {n: 1e-3 * torch.randn(*s, generator=gen) for n, s in shapes.items()}
        header = UpdateHeader(base_version=base, c_tokens=tokens, c_steps=steps, c_seconds=1.0)
        answers[f"{m}-0"] = Answer(f"{m}-0", header, delta)
    proposal = frag.propose(answers, r)

    ans = [answers[c] for c in sorted(answers)]
    discounts = [(1 + 5 - a.header.base_version) ** -0.5 for a in ans]
    weights = [a.header.c_tokens**2 / a.header.c_steps * f for a, f in zip(ans, discounts, strict=True)]
    for n in shapes:
        grads = [-a.delta[n].double() for a in ans]
        if n == "wte.weight":
            merged = sum(w * g for w, g in zip(weights, grads, strict=True)) / sum(weights)
        else:
            merged = rda64(grads, weights)
        g = max(discounts) * merged
        expected = theta[n].double() - 0.7 * (1 + 0.9) * g
        torch.testing.assert_close(proposal.theta[n].double(), expected, rtol=0, atol=1e-6)
    for c, a, f in zip(sorted(answers), ans, discounts, strict=True):
        rec = proposal.contributors[c]
        assert rec.staleness == 5 - a.header.base_version
        assert rec.weight == a.header.c_tokens**2 / a.header.c_steps
        assert rec.discount == pytest.approx(f)


def test_a_zero_staleness_exponent_weighs_answers_by_tokens_alone():
    gen = torch.Generator().manual_seed(4)
    theta = {GAIN: torch.randn(16, generator=gen)}
    deltas = [{GAIN: 1e-3 * torch.randn(16, generator=gen)} for _ in range(2)]

    def step(r: MergeRule, bases: tuple[int, int]) -> torch.Tensor:
        frag = GlobalFragment(0, 3, {GAIN: theta[GAIN].clone()}, r.optimizer(), Ledger(), read=None)
        answers = {
            f"{m}-0": Answer(f"{m}-0", UpdateHeader(base_version=b, c_tokens=64, c_steps=1, c_seconds=1.0), d)
            for m, (b, d) in enumerate(zip(bases, deltas, strict=True))
        }
        return frag.propose(answers, r).theta[GAIN]

    off = rule(staleness_exponent=0.0)
    assert torch.equal(step(off, (0, 2)), step(off, (3, 3)))
    assert not torch.equal(step(rule(), (0, 2)), step(rule(), (3, 3)))


def test_the_last_merge_while_the_run_closes_is_the_learners_mean_without_the_look_ahead():
    """`propose(final=True)` (a round merged while the run closes, `ddiloco.syncer.drain`): Θ_p − Δ with Δ
    the plain weighted mean, RDA tensors too: the learners' weighted mean. Not the outer Nesterov step (the
    code before): a closing round of a few steps moved the fragment mostly by the momentum's look-ahead,
    m²·buf of earlier full rounds, with nothing training after it (40M tokens, docs/results.md §12.10: the
    closing rounds took three runs' validation loss up by 1.4%, 1.6% and 2.9%). Not RDA's length either: RDA
    restores the answers' mean norm, 1/cos of their spread longer than their mean, and with nothing after it
    that overshoots too (the same runs: half of the RDA step did better than the whole)."""
    torch.manual_seed(0)
    theta = {GAIN: torch.randn(64)}
    r = Run(theta, "fp32", rule())  # RDA on the gain
    for v in range(3):  # three full rounds fill the momentum
        r.merge([r.answer("a", v, 0.05), r.answer("b", v, 0.05)])
    before, buf = r.frag.theta[GAIN].clone(), r.frag.outer.state_dict()[GAIN].clone()
    sa, sb = torch.zeros(64), torch.zeros(64)
    sa[:32], sb[32:] = 0.02, 0.04  # orthogonal progress: their mean is 1/√2·… shorter than RDA's step
    short = [r.answer("a", 3, {GAIN: sa}), r.answer("b", 3, {GAIN: sb})]
    outer = r.frag.propose({a.contributor: a for a in short}, r.rule)
    closing = r.frag.propose({a.contributor: a for a in short}, r.rule, final=True)
    torch.testing.assert_close(closing.theta[GAIN], before + (sa + sb) / 2, rtol=0, atol=1e-6)
    rnd = Round(7, 0, 0.0, 0.0)
    steps = [p.record(rnd, now=0.0, merged_at=0.0).step for p in (closing, outer)]
    assert steps == ["mean", "outer"]
    # the momentum is updated with the merged outer gradient as in any merge
    assert closing.outer.state_dict()[GAIN].shape == buf.shape
    # the outer step went far past the learners' mean
    moved = (outer.theta[GAIN] - before).norm().item()
    assert moved > 5 * ((sa + sb) / 2).norm().item(), f"the outer step moved {moved:.4f}: no look-ahead shown"
