"""Schedule-aware outer momentum (`ddiloco.syncer.merge.outer.OuterNesterov` lr_scale, `MergeRule.lr_scale`): the outer
step anneals with the learners' inner rate, as torch's SGD momentum does under an LR schedule."""

import uuid

import pytest
import torch

from ddiloco.config.run import DilocoConfig, TrainConfig
from ddiloco.protocol import signing
from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.wire import RunSigner
from ddiloco.run.fragments import Fragment
from ddiloco.run.globalmodel import Layout, publish_global
from ddiloco.run.root import RunRoot
from ddiloco.run.schedule import decay_factor
from ddiloco.store.memory import MemoryStore
from ddiloco.syncer.fragment import MergeRule
from ddiloco.syncer.merge.outer import OuterNesterov
from ddiloco.syncer.rounds import Answer, Round
from ddiloco.syncer.state import SyncerFiles

SCALES = [1.0, 1.0, 0.8, 0.5, 0.25, 0.1, 0.1]


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_outer_steps_match_torch_sgd_on_rate_free_gradients_at_the_scheduled_rate() -> None:
    """Δ_k = η_k·ĝ_k stepped with lr_scale η_k equals torch SGD (Nesterov) on ĝ_k with lr = lr_o·η_k."""
    ours = {"big": _randn(300_000, seed=0), "mat": _randn(16, 9, seed=1)}  # "big" spans chunks
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in ours.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterNesterov(lr=0.7, momentum=0.9)
    for k, eta in enumerate(SCALES):
        g = {n: _randn(*t.shape, seed=100 + 10 * k + i) for i, (n, t) in enumerate(ours.items())}
        for n, p in ref.items():
            p.grad = g[n].clone()
        for group in sgd.param_groups:
            group["lr"] = 0.7 * eta
        sgd.step()
        opt.step(ours, {n: eta * t for n, t in g.items()}, lr_scale=eta)
        assert opt.lr_scale == eta
        for n, p in ref.items():
            torch.testing.assert_close(ours[n], p.detach(), rtol=1e-5, atol=1e-6)


def test_a_decayed_rate_shrinks_the_momentum_part_of_the_step() -> None:
    """After ten steps of Δ = 1 at full rate, a zero Δ at a tenth of the rate moves 0.7·0.9·buf·0.09 (the
    buffer rescaled by 0.1), not the old rule's 0.7·0.9·0.9·buf."""
    plain, scaled = OuterNesterov(), OuterNesterov()
    a, b = {"w": torch.zeros(4)}, {"w": torch.zeros(4)}
    for _ in range(10):
        plain.step(a, {"w": torch.ones(4)})
        scaled.step(b, {"w": torch.ones(4)}, lr_scale=1.0)
    assert torch.equal(a["w"], b["w"])  # a constant scale is the plain rule, bit for bit
    buf = plain.state_dict()["w"].clone()
    before_a, before_b = a["w"].clone(), b["w"].clone()
    plain.step(a, {"w": torch.zeros(4)})
    scaled.step(b, {"w": torch.zeros(4)}, lr_scale=0.1)
    torch.testing.assert_close(before_a - a["w"], 0.7 * 0.9 * 0.9 * buf)
    torch.testing.assert_close(before_b - b["w"], 0.7 * 0.9 * 0.9 * 0.1 * buf)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_a_bad_scale_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="lr_scale"):
        OuterNesterov().step({"w": torch.zeros(2)}, {"w": torch.ones(2)}, lr_scale=bad)


LAYOUT = Layout(
    fragments=[Fragment(0, ("g",), 16)], shapes={"g": [16]}, embedding_names=frozenset(), model={}
)


def _rule(follows: bool, schedule: str = "cosine") -> MergeRule:
    d = DilocoConfig(token_budget=1000, momentum_follows_lr=follows)
    return MergeRule.of(d, LAYOUT, None, TrainConfig(lr_schedule=schedule, lr_min_ratio=0.1))


def test_the_rule_follows_the_learners_schedule_on_merged_tokens() -> None:
    rule = _rule(True)
    for tokens in (0, 250, 500, 999, 1000, 5000):
        assert rule.lr_scale(tokens) == pytest.approx(decay_factor(tokens / 1000, "cosine", 0.1))
    assert rule.lr_scale(1000) == pytest.approx(0.1)
    assert _rule(False).lr_scale(900) == 1.0 and _rule(True, "constant").lr_scale(900) == 1.0
    no_train = MergeRule.of(DilocoConfig(token_budget=1000), LAYOUT, None)
    assert not no_train.momentum_follows_lr and no_train.lr_scale(900) == 1.0
    wsd = TrainConfig(lr_schedule="wsd", lr_min_ratio=0.1, lr_decay_fraction=0.4)
    rule = MergeRule.of(DilocoConfig(token_budget=1000), LAYOUT, None, wsd)
    assert [rule.lr_scale(t) for t in (0, 600)] == [1.0, 1.0]  # stable until the cool-down
    assert rule.lr_scale(700) == pytest.approx(decay_factor(0.7, "wsd", 0.1, 0.4))
    assert rule.lr_scale(700) < 1.0


def test_the_scale_is_saved_with_the_momentum_and_a_restart_continues_bit_for_bit() -> None:
    run, key = "r", signing.for_run(b"sched-key" * 4, "r")
    rule = _rule(True)

    def answers(frag) -> dict[str, Answer]:
        header = UpdateHeader(base_version=frag.version, c_tokens=640, c_steps=10, c_seconds=1.0)
        return {
            f"{m}-0": Answer(f"{m}-0", header, {"g": torch.full((16,), 1e-3 * (m + 1))}) for m in range(2)
        }

    store = MemoryStore(f"outer-sched-{uuid.uuid4().hex}")
    publish_global(store, RunSigner(run, key), 0, 0, {"g": torch.zeros(16)}, "fp32")
    f = SyncerFiles(RunRoot(store, run, key), LAYOUT, "fp32")
    frag = f.resume(rule, 0.0).fragments[0]
    for r, tokens in enumerate((0, 300, 600)):
        proposal = frag.propose(answers(frag), rule, tokens_merged=tokens)
        f.publish(proposal, proposal.record(Round(r, 0, 0.0, 0.0), now=0.0, merged_at=0.0))
        frag.commit(proposal, published_at=0.0, clock=0.0)
    assert frag.outer.lr_scale == pytest.approx(rule.lr_scale(600))
    restarted = SyncerFiles(RunRoot(store, run, key), LAYOUT, "fp32").resume(rule, 0.0).fragments[0]
    assert restarted.outer.lr_scale == frag.outer.lr_scale
    going_on = frag.propose(answers(frag), rule, tokens_merged=900)
    after_restart = restarted.propose(answers(restarted), rule, tokens_merged=900)
    assert torch.equal(after_restart.theta["g"], going_on.theta["g"])
