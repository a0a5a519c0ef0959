"""Robust merging in `RoundSums`: clipping applied exactly, whatever the outlier's size (issue 49 item 3).

The reference is the batch merge of `tests/merge_reference.py` after `validation.clip_outliers` (clip, then
merge): the streaming path must agree with it to ~1e-6 relative, per tensor."""

from __future__ import annotations

import pytest
import torch

from ddiloco.accumulate import RoundSums
from ddiloco.protocol.validation import clip_outliers
from tests.merge_reference import merge

SHAPES = {"wte": (64, 16), "h.0.w": (32, 32), "h.0.b": (32,)}
EMB = frozenset({"wte"})


def _answers(m: int, seed: int, scale: list[float]) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(s, generator=g) * scale[i] for n, s in SHAPES.items()} for i in range(m)]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("outlier", [1e3, 1e6, 1e12])
def test_clipping_an_outlier_of_any_size_equals_clipping_first(method, outlier):
    """A plain mean's sum held the outlier at its full size; subtracting its clipped excess left that
    size's rounding behind (relative error 5e-4 at 1e3, 0.34 at 1e6, everything at 1e12)."""
    answers = _answers(5, seed=11, scale=[1.0, 1.2, outlier, 0.8, 1.0])
    weights = [1.0, 2.0, 1.5, 1.0, 0.5]
    sums = RoundSums(SHAPES, method=method, embedding_names=EMB)
    for i, (a, w) in enumerate(zip(answers, weights, strict=True)):
        sums.add(str(i), w, a)
    reads = []

    def reread(key, out=None):
        reads.append(key)
        return answers[int(key)]

    done = sums.finalize(reread, 3.0)
    clipped, scales = clip_outliers(answers, 3.0)
    assert set(scales) == {2} and set(done.clipped) == {"2"}
    want = merge(clipped, weights, embedding_names=EMB, method=method)
    for n, t in want.items():
        assert _relative_error(done.merged[n], t) < 1e-6, n
    assert sorted(reads) == ["0", "1", "2", "3", "4"], "the plain means are summed again, each answer read once"
