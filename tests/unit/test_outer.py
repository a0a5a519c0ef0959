"""Merge (weights, RDA, mean) and the outer Nesterov optimizer, checked against plain references."""

import math

import pytest
import torch
from safetensors.torch import load, save

from ddiloco.syncer.merge.outer import OuterNesterov, staleness_discount, token_weight
from tests.merge_reference import (
    merge,
    merge_with_stats,
    rda,
    weighted_mean,
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the machine is shared; conftest does the same for full runs


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rda_reference(deltas: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The paper's formula, literally, in float64."""
    d = [x.double() for x in deltas]
    w = torch.tensor(weights, dtype=torch.float64)
    radius = sum(wi * x.norm() for wi, x in zip(w, d, strict=True)) / w.sum()
    direction = sum(wi * x / x.norm() for wi, x in zip(w, d, strict=True)) / w.sum()
    return (radius * direction / direction.norm()).float()


def test_token_weight() -> None:
    assert token_weight(1000, 4) == 250_000.0
    assert token_weight(1000, 0) == 0.0 and token_weight(0, 3) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        token_weight(-1, 2)


def test_staleness_discount() -> None:
    assert staleness_discount(0, 0.5) == 1.0 and staleness_discount(7, 0.0) == 1.0
    assert staleness_discount(3, 0.5) == 0.5
    assert staleness_discount(1, 1.0) == 0.5
    for bad in ((-1, 0.5), (1, -0.5), (1, math.inf)):
        with pytest.raises(ValueError):
            staleness_discount(*bad)


def test_weighted_mean_matches_manual() -> None:
    xs = [randn(5, 7, seed=i) for i in range(3)]
    w = [1.0, 2.0, 5.0]
    torch.testing.assert_close(weighted_mean(xs, w), (xs[0] + 2 * xs[1] + 5 * xs[2]) / 8)


def test_rda_matches_formula() -> None:
    xs = [randn(33, 17, seed=i) * (i + 1) for i in range(4)]  # unequal norms
    w = [3.0, 1.0, 0.5, 2.0]
    torch.testing.assert_close(rda(xs, w), rda_reference(xs, w))


def test_rda_keeps_the_norm_of_equal_norm_inputs() -> None:
    xs = [randn(4096, seed=i) for i in range(8)]
    xs = [x / x.norm() * 3.0 for x in xs]
    out = rda(xs, [1.0, 2.0, 3.0, 4.0, 1.0, 1.0, 1.0, 1.0])
    assert out.norm().item() == pytest.approx(3.0, rel=1e-5)
    assert weighted_mean(xs, [1.0] * 8).norm().item() < 1.5  # what RDA is there to avoid


def test_one_learner_is_the_identity() -> None:
    x = randn(100, seed=0) * 1e-3
    assert torch.equal(rda([x], [7.0]), x)
    assert torch.equal(rda([randn(100, seed=1), x, randn(100, seed=2)], [0.0, 3.0, 0.0]), x)
    assert torch.equal(weighted_mean([x, randn(100, seed=1)], [2.0, 0.0]), x)


def test_rda_degenerate_directions_fall_back_to_mean() -> None:
    x = randn(64, seed=0)
    out, stats = merge_with_stats([{"w": x}, {"w": -x}], [1.0, 1.0])
    assert torch.equal(out["w"], torch.zeros(64)) and stats["fallbacks"] == 1.0
    assert stats["ratio"] == 0.0
    assert torch.equal(rda([torch.zeros(8), torch.zeros(8)], [1.0, 1.0]), torch.zeros(8))


def test_rda_zero_delta_adds_length_but_no_direction() -> None:
    x = randn(64, seed=0)
    torch.testing.assert_close(rda([torch.zeros(64), x], [1.0, 1.0]), x / 2)


def test_merge_uses_mean_for_embeddings_and_rda_elsewhere() -> None:
    names = ("wte.weight", "h.0.mlp.weight", "h.0.ln.bias")
    deltas = [{n: randn(48, 8, seed=10 * m + i) for i, n in enumerate(names)} for m in range(3)]
    w = [token_weight(4096, 4), token_weight(2048, 1), token_weight(1024, 2)]
    out = merge(deltas, w, embedding_names={"wte.weight"})
    assert list(out) == list(names) and all(t.dtype == torch.float32 for t in out.values())
    torch.testing.assert_close(out["wte.weight"], weighted_mean([d["wte.weight"] for d in deltas], w))
    for n in names[1:]:
        torch.testing.assert_close(out[n], rda_reference([d[n] for d in deltas], w))
    plain = merge(deltas, w, method="mean")
    for n in names:
        torch.testing.assert_close(plain[n], weighted_mean([d[n] for d in deltas], w))


def test_zero_step_learner_is_ignored() -> None:
    a, b = {"w": randn(10, seed=0)}, {"w": randn(10, seed=1)}
    out = merge([a, b], [token_weight(100, 2), token_weight(50, 0)])
    assert torch.equal(out["w"], a["w"])


def test_merge_bf16_inputs_and_out_buffers() -> None:
    deltas = [{"w": randn(300_000, seed=m).bfloat16()} for m in range(3)]  # > one chunk
    buf = {"w": torch.empty(300_000)}
    out = merge(deltas, [1.0, 1.0, 2.0], out=buf)
    assert out["w"] is buf["w"]
    ref = rda_reference([d["w"].float() for d in deltas], [1.0, 1.0, 2.0])
    torch.testing.assert_close(out["w"], ref, rtol=1e-4, atol=1e-4)  # fp32 norms over 300k values


@pytest.mark.parametrize(
    ("method", "expected"), [("rda", 1.0), ("mean", 1 / math.sqrt(8))], ids=["rda", "mean"]
)
def test_stats_ratio(method: str, expected: float) -> None:
    deltas = [{"a": randn(8192, seed=m), "b": randn(64, 64, seed=100 + m)} for m in range(8)]
    _, stats = merge_with_stats(deltas, [1.0] * 8, method=method)
    assert stats["ratio"] == pytest.approx(expected, rel=0.05)
    assert stats["ratio"] == pytest.approx(stats["merged_norm"] / stats["mean_delta_norm"])
    assert stats["learners"] == 8.0
    norms = [math.sqrt(d["a"].norm() ** 2 + d["b"].norm() ** 2) for d in deltas]
    assert stats["mean_delta_norm"] == pytest.approx(sum(norms) / 8, rel=1e-5)


def test_merge_errors() -> None:
    a, b = {"w": torch.ones(4)}, {"w": torch.ones(4)}
    cases = [
        (([a, b], [1.0, -1.0]), {}, "finite and >= 0"),
        (([a, b], [1.0, float("nan")]), {}, "finite and >= 0"),
        (([a, b], [0.0, 0.0]), {}, "all merge weights are 0"),
        (([a, b], [1.0]), {}, "1 weights for 2 deltas"),
        (([], []), {}, "nothing to merge"),
        (([a, {"v": torch.ones(4)}], [1.0, 1.0]), {}, r"missing \['w'\], extra \['v'\]"),
        (([a, {"w": torch.ones(5)}], [1.0, 1.0]), {}, "shape"),
        (([a, {"w": torch.ones(4, dtype=torch.int64)}], [1.0, 1.0]), {}, "floating-point"),
        (([a, {"w": torch.tensor([1.0, float("inf"), 0, 0])}], [1.0, 1.0]), {}, "NaN/Inf"),
        (([{"w": torch.tensor([float("nan")] * 4)}], [1.0]), {}, "NaN/Inf"),  # even alone
        (([a, b], [1.0, 1.0]), {"method": "median"}, "rda, mean"),
        (([a, b], [1.0, 1.0]), {"out": {"v": torch.ones(4)}}, "out must"),
        (([a, b], [1.0, 1.0]), {"out": {"w": torch.ones(4, dtype=torch.float64)}}, "out must"),
    ]
    for args, kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            merge(*args, **kwargs)


def _params(seed: int) -> dict[str, torch.Tensor]:
    return {"big": randn(300_000, seed=seed), "mat": randn(16, 9, seed=seed + 1)}  # "big" spans chunks


def test_nesterov_matches_torch_sgd() -> None:
    ours = _params(0)
    ref = {n: torch.nn.Parameter(t.clone()) for n, t in ours.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterNesterov(lr=0.7, momentum=0.9)
    for step in range(5):
        grads = {n: randn(*t.shape, seed=100 + 10 * step + i) for i, (n, t) in enumerate(ours.items())}
        for n, p in ref.items():
            p.grad = grads[n].clone()
        sgd.step()
        opt.step(ours, grads)
        for n, p in ref.items():
            torch.testing.assert_close(ours[n], p.detach())
            torch.testing.assert_close(opt.state_dict()[n], sgd.state[p]["momentum_buffer"])


def test_nesterov_state_round_trip() -> None:
    grads = [{n: randn(*t.shape, seed=50 + s) for n, t in _params(0).items()} for s in range(4)]
    straight, p1 = OuterNesterov(), _params(0)
    for g in grads:
        straight.step(p1, g)
    first, p2 = OuterNesterov(), _params(0)
    for g in grads[:2]:
        first.step(p2, g)
    resumed = OuterNesterov()
    resumed.load_state_dict(load(save(first.state_dict())))
    for g in grads[2:]:
        resumed.step(p2, g)
    for n in p1:
        assert torch.equal(p1[n], p2[n])


def test_nesterov_steps_one_fragment_at_a_time() -> None:
    opt, params = OuterNesterov(), {"a": torch.zeros(3), "b": torch.zeros(2)}
    opt.step({"a": params["a"]}, {"a": torch.ones(3)})
    assert set(opt.state_dict()) == {"a"} and torch.equal(params["b"], torch.zeros(2))
    torch.testing.assert_close(params["a"], torch.full((3,), -0.7 * 1.9))  # p -= lr * (g + m * g)


def test_nesterov_errors() -> None:
    opt = OuterNesterov()
    with pytest.raises(ValueError, match="lacks"):
        opt.step({"a": torch.zeros(2)}, {"b": torch.zeros(2)})
    with pytest.raises(ValueError, match="shape"):
        opt.step({"a": torch.zeros(2)}, {"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="float32"):
        opt.step({"a": torch.zeros(2, dtype=torch.bfloat16)}, {"a": torch.zeros(2)})
    opt.load_state_dict({"a": torch.zeros(3)})
    with pytest.raises(ValueError, match="momentum for 'a' has shape"):
        opt.step({"a": torch.zeros(2)}, {"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="NaN/Inf"):
        opt.load_state_dict({"a": torch.tensor([float("nan")])})
    with pytest.raises(ValueError, match="floating-point"):
        opt.load_state_dict({"a": [0.0]})
    with pytest.raises(ValueError, match="lr"):
        OuterNesterov(lr=0.0)
    with pytest.raises(ValueError, match="momentum"):
        OuterNesterov(momentum=1.0)
