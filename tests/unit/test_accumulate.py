"""`RoundSums` (answers added one at a time, merged at finalisation) against the batch merge.

The reference is `validation.clip_outliers` followed by `merge.merge_with_stats`, itself checked against
independent references in test_merge*.py; the streaming path must agree with it to 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.protocol.validation import clip_outliers
from ddiloco.syncer.merge.accumulate import RoundSums
from ddiloco.syncer.merge.bufferpool import BufferPool
from tests.merge_reference import merge_with_stats

SHAPES = {"wte": (16, 8), "h.0.w": (8, 8), "h.0.b": (8,), "ln.g": (8,)}
EMB = frozenset({"wte"})


def _answers(m: int, seed: int, *, scale=None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        s = 1.0 if scale is None else scale[i]
        out.append({n: torch.randn(shape, generator=g) * s for n, shape in SHAPES.items()})
    return out


def _streamed(answers, weights, *, method="rda", robust_clip=None):
    sums = RoundSums(SHAPES, method=method, embedding_names=EMB)
    reads = []

    def reread(key, out=None):
        reads.append(key)
        return answers[int(key)]

    for i, (a, w) in enumerate(zip(answers, weights, strict=True)):
        sums.add(str(i), w, a)
    return sums.finalize(reread, robust_clip), reads


def _batch(answers, weights, *, method="rda", robust_clip=None):
    grads, scales = (answers, {}) if robust_clip is None else clip_outliers(answers, robust_clip)
    merged, stats = merge_with_stats(grads, weights, embedding_names=EMB, method=method)
    return merged, stats, {str(i): s for i, s in scales.items()}


def _assert_same(streamed, batch):
    merged, stats, clipped = batch
    assert set(streamed.merged) == set(merged)
    for n, t in merged.items():
        torch.testing.assert_close(streamed.merged[n], t, rtol=1e-6, atol=1e-6)
    for k in ("merged_norm", "mean_delta_norm", "ratio", "fallbacks", "learners"):
        assert streamed.stats[k] == pytest.approx(stats[k], rel=1e-6, abs=1e-9), k
    assert streamed.clipped == pytest.approx(clipped)


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("m", [2, 3, 8, 16])
def test_streamed_merge_equals_the_batch_merge(method, m):
    answers = _answers(m, seed=m)
    weights = [float(1 + (i * 7) % 5) for i in range(m)]
    streamed, reads = _streamed(answers, weights, method=method)
    _assert_same(streamed, _batch(answers, weights, method=method))
    assert reads == [], "no answer is read twice without clipping"


@pytest.mark.parametrize("method", ["rda", "mean"])
def test_robust_clipping_at_finalisation_equals_clipping_first(method):
    answers = _answers(6, seed=1, scale=[1.0, 1.1, 0.9, 25.0, 1.0, 40.0])  # two outliers
    weights = [1.0, 2.0, 1.0, 3.0, 1.0, 0.5]
    streamed, reads = _streamed(answers, weights, method=method, robust_clip=2.0)
    batch = _batch(answers, weights, method=method, robust_clip=2.0)
    assert set(batch[2]) == {"3", "5"}
    _assert_same(streamed, batch)
    assert sorted(reads) == [str(i) for i in range(6)], "a clip rereads each answer once (exact plain means)"


def test_one_answer_gives_back_exactly_its_delta_scaled_if_clipped():
    answers = _answers(3, seed=2, scale=[1.0, 50.0, 1.0])
    weights = [0.0, 3.0, 0.0]  # one answer with positive weight; the zero-weight ones count in the median
    for clip in (None, 2.0):
        streamed, reads = _streamed(answers, weights, robust_clip=clip)
        merged, _, clipped = _batch(answers, weights, robust_clip=clip)
        for n, t in merged.items():
            assert torch.equal(streamed.merged[n], t), (clip, n)
        assert reads == ["1"] and streamed.clipped == pytest.approx(clipped)


def test_one_answer_is_read_again_into_a_pooled_buffer_and_is_exactly_its_delta():
    """The single-answer merge decodes the answer once more: into a buffer of closed rounds (`out`), not
    into fresh memory and then a second fresh copy (2 x ~0.1 s of page faults per 193 MB fragment)."""
    answers = _answers(2, seed=5, scale=[1.0, 3.0])
    numel = sum(math.prod(s) for s in SHAPES.values())
    pool = BufferPool(keep=2)
    pool.give(torch.empty(numel))
    pool.give(torch.empty(numel))
    sums = RoundSums(SHAPES, embedding_names=EMB, pool=pool)
    into = []

    def reread(key, out=None):
        into.append(out is not None)
        for n, t in answers[int(key)].items():
            out[n].copy_(t)
        return out

    sums.add("0", 0.0, answers[0])
    sums.add("1", 2.0, answers[1])
    done = sums.finalize(reread)
    assert into == [True] and pool.allocated == 0 and done.flat is not None
    for n, t in answers[1].items():
        assert torch.equal(done.merged[n], t)
        assert done.merged[n].untyped_storage().data_ptr() == done.flat.untyped_storage().data_ptr()


def test_opposite_answers_fall_back_to_the_mean_like_the_batch_merge():
    a = _answers(1, seed=3)[0]
    answers = [a, {n: -t for n, t in a.items()}]
    streamed, _ = _streamed(answers, [1.0, 1.0])
    _assert_same(streamed, _batch(answers, [1.0, 1.0]))
    assert streamed.stats["fallbacks"] == len(SHAPES) - len(EMB)


def test_finalize_leaves_the_sums_as_they_were():
    answers = _answers(4, seed=4, scale=[1.0, 1.0, 30.0, 1.0])
    sums = RoundSums(SHAPES, embedding_names=EMB)
    for i, a in enumerate(answers):
        sums.add(str(i), 1.0, a)
    first = sums.finalize(lambda k: answers[int(k)], 2.0)
    again = sums.finalize(lambda k: answers[int(k)], 2.0)
    for n in SHAPES:
        assert torch.equal(first.merged[n], again.merged[n])


@pytest.mark.parametrize("method", ["rda", "mean"])
@pytest.mark.parametrize("clip", [None, 2.0])
def test_finalize_applies_the_callers_scale_in_its_pass(method, clip):
    # The syncer passes -discount (Δ = -merge(δ), damped for stale rounds); norms are of the scaled merge.
    answers = _answers(5, seed=6, scale=[1.0, 1.0, 30.0, 1.0, 1.0])
    weights = [1.0, 2.0, 1.0, 1.0, 0.5]
    sums = RoundSums(SHAPES, method=method, embedding_names=EMB)
    for i, (a, w) in enumerate(zip(answers, weights, strict=True)):
        sums.add(str(i), w, a)
    plain = sums.finalize(lambda k, out=None: answers[int(k)], clip)
    scaled = sums.finalize(lambda k, out=None: answers[int(k)], clip, scale=-0.5)
    for n, t in plain.merged.items():
        torch.testing.assert_close(scaled.merged[n], -0.5 * t, rtol=1e-6, atol=1e-9)
    assert scaled.stats["merged_norm"] == pytest.approx(0.5 * plain.stats["merged_norm"], rel=1e-6)
    assert scaled.stats["ratio"] == pytest.approx(0.5 * plain.stats["ratio"], rel=1e-6)
    assert scaled.stats["mean_delta_norm"] == plain.stats["mean_delta_norm"]


def test_a_reused_buffer_is_never_read_before_an_answer_wrote_it():
    # Sums come from a pool without zeroing: the first answer overwrites; a tensor no answer wrote (here
    # one whose delta is exactly 0 in every answer, and a zero-weight answer) must still merge as 0.
    numel = sum(math.prod(s) for s in SHAPES.values())
    pool = BufferPool(keep=2)
    pool.give(torch.full((numel,), float("nan")))
    answers = _answers(3, seed=7)
    for a in answers:
        a["ln.g"].zero_()
    sums = RoundSums(SHAPES, embedding_names=EMB, pool=pool)
    weights = [0.0, 1.0, 3.0]
    for i, (a, w) in enumerate(zip(answers, weights, strict=True)):
        sums.add(str(i), w, a)
    done = sums.finalize(lambda k, out=None: answers[int(k)])
    assert torch.equal(done.merged["ln.g"], torch.zeros(SHAPES["ln.g"]))
    _assert_same(done, _batch(answers, weights))


def test_memory_is_two_fragments_whatever_the_number_of_answers():
    sums = RoundSums(SHAPES, embedding_names=EMB)
    fragment = sum(torch.Size(s).numel() * 4 for s in SHAPES.values())
    before = sums.nbytes()
    for i, a in enumerate(_answers(16, seed=5)):
        sums.add(str(i), 1.0, a)
    assert sums.nbytes() == before <= 2 * fragment


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"wte": torch.zeros(16, 8)}, "lacks tensors"),
        ({**{n: torch.zeros(s) for n, s in SHAPES.items()}, "h.0.b": torch.zeros(9)}, "shape"),
        ({**{n: torch.zeros(s) for n, s in SHAPES.items()}, "ln.g": torch.full((8,), float("nan"))}, "NaN"),
    ],
)
def test_a_bad_answer_is_refused_whole_and_leaves_no_partial_sum(bad, match):
    sums = RoundSums(SHAPES, embedding_names=EMB)
    good = _answers(1, seed=6)[0]
    sums.add("0", 1.0, good)
    snapshot = {n: t.clone() for n, t in sums.sums.items()}
    with pytest.raises(ValueError, match=match):
        sums.add("1", 1.0, bad)
    assert len(sums) == 1
    for n, t in snapshot.items():
        assert torch.equal(sums.sums[n], t)


def test_the_same_answer_twice_and_no_positive_weight_are_refused():
    sums = RoundSums(SHAPES)
    a = _answers(1, seed=7)[0]
    sums.add("0", 0.0, a)
    with pytest.raises(ValueError, match="already"):
        sums.add("0", 1.0, a)
    with pytest.raises(ValueError, match="nothing to merge"):
        sums.finalize(lambda k: a)
