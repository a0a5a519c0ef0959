"""`ddiloco.codec.encoded`: answers checked whole while encoded, then decoded chunk by chunk into running sums.

References: `ddiloco.codec.registry.decode` of the same parts, fp64 norms, and the batch merge
(`merge.merge_with_stats`, itself checked against independent references in test_merge*.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco.codec.base import BLOCK
from ddiloco.codec.blockwise import codes_in_range
from ddiloco.codec.encoded import EncodedTensor
from ddiloco.codec.registry import decode, encode
from ddiloco.syncer.merge.accumulate import RoundSums
from tests.merge_reference import merge_with_stats

INT_CODECS = ("int8", "int4", "int2")


def _x(n: int, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("codec", ["fp32", "bf16", *INT_CODECS])
@pytest.mark.parametrize("n", [1, 127, 128, 1000, (1 << 19) + 77])
def test_accumulate_adds_exactly_the_decoded_values_and_measures_their_norm(codec, n):
    parts = encode(_x(n), codec)
    ref = decode(parts, codec, (n,))
    t = EncodedTensor.check(parts, codec, (n,))
    acc = _x(n, seed=1)
    want = acc.clone().add_(ref, alpha=0.37)
    norm = t.accumulate(acc, 0.37)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-9)  # codes × (scale · alpha): rounding only
    exact = float(torch.linalg.vector_norm(ref.double()))
    assert norm == pytest.approx(exact, rel=1e-7, abs=1e-12)
    assert t.norm() == norm  # what a learner claims is what the syncer measures
    assert torch.equal(t.decode(), ref)


@pytest.mark.parametrize("codec", ["fp32", "bf16", *INT_CODECS])
@pytest.mark.parametrize("n", [127, 1000, (1 << 20) + 77])  # a padded last block, and two chunks
def test_overwrite_writes_the_decoded_values_whatever_the_buffer_held(codec, n):
    parts = encode(_x(n), codec)
    t = EncodedTensor.check(parts, codec, (n,))
    added = torch.zeros(n)
    t.accumulate(added, 0.37)
    for src in (t, t.measured()):  # measuring in the same pass, and a norm a reader measured before
        acc = torch.full((n,), float("nan"))  # a pooled buffer of a closed round: anything, NaN included
        assert src.accumulate(acc, 0.37, overwrite=True) == t.norm()
        assert torch.equal(acc, added)  # the same products, with nothing of the old contents left


def test_norms_of_large_tensors_are_fp64_exact():
    # A single fp32 reduction is off by ~9e-5 at 4M values (0.6% at 48M, a 1b fragment); RDA divides by it.
    n = 4 << 20
    x = _x(n)
    sums = RoundSums({"w": (n,)}, method="rda")
    norms = sums.add("a", 1.0, {"w": x}).norms
    assert norms["w"] == pytest.approx(float(torch.linalg.vector_norm(x.double())), rel=1e-6)


@pytest.mark.parametrize("codec", INT_CODECS)
@pytest.mark.parametrize("offset", [0, 3])  # aligned words, and the unpacking fallback
def test_out_of_range_codes_are_found_anywhere_without_unpacking(codec, offset):
    n = 5000
    q = encode(_x(n), codec)["q"]
    assert codes_in_range(q, codec)
    bits = {"int8": 8, "int4": 4, "int2": 2}[codec]
    bad_code = (1 << bits) - 1  # 2L + 1: the only code above the range
    for byte in (0, 7, q.numel() // 2, q.numel() - 1):
        for slot in range(8 // bits):
            bad = torch.cat([torch.zeros(offset, dtype=torch.uint8), q.clone()])[offset:]
            v = int(bad[byte]) & ~(bad_code << (slot * bits)) | (bad_code << (slot * bits))
            bad[byte] = v
            assert not codes_in_range(bad, codec), (byte, slot)


@pytest.mark.parametrize("codec", INT_CODECS)
@pytest.mark.parametrize("n", [5000, 128 * 8192 + 300])  # one chunk; two chunks, the last one partial
def test_a_check_that_measures_finds_out_of_range_codes_in_its_own_pass(codec, n, monkeypatch):
    q = encode(_x(n), codec)["q"]
    bits = {"int8": 8, "int4": 4, "int2": 2}[codec]
    bad_code = (1 << bits) - 1
    parts = {"q": q, "scale": encode(_x(n), codec)["scale"]}
    good = EncodedTensor.check(parts, codec, (n,), measure=True)
    assert good.known_norm == EncodedTensor.check(parts, codec, (n,)).norm()
    monkeypatch.setattr("ddiloco.codec.blockwise.codes_in_range", lambda *a: pytest.fail("a pass of its own"))
    for byte in (0, q.numel() // 2, q.numel() - 1):  # the last byte is in the padding of the last block
        for slot in range(8 // bits):
            bad = q.clone()
            bad[byte] = int(bad[byte]) | (bad_code << (slot * bits))
            with pytest.raises(ValueError, match="out of range"):
                EncodedTensor.check({**parts, "q": bad}, codec, (n,), measure=True)


@pytest.mark.parametrize(
    ("codec", "tamper", "words"),
    [
        ("int4", lambda p: p["scale"].__setitem__(3, float("nan")), "NaN/Inf"),
        ("int4", lambda p: p["scale"].__setitem__(3, -1.0), "negative"),
        ("int8", lambda p: p["scale"].__setitem__(3, 1e37), "overflow"),
        ("int4", lambda p: p["q"].__setitem__(10, 0xFF), "out of range"),
        ("fp32", lambda p: p["data"].__setitem__(10, float("inf")), "NaN/Inf"),
        ("bf16", lambda p: p["data"].__setitem__(10, float("nan")), "NaN/Inf"),
    ],
)
def test_a_bad_tensor_is_refused_before_any_value_is_added(codec, tamper, words):
    n = 2000
    parts = {k: v.clone() for k, v in encode(_x(n), codec).items()}
    tamper(parts)
    with pytest.raises(ValueError, match=words):
        EncodedTensor.check(parts, codec, (n,))


SHAPES = {"wte": (64, 32), "h.0.w": (96, 64), "ln.g": (700,)}
EMB = frozenset({"wte"})


def _encoded_answers(m, codec="int4"):
    answers, encoded = [], []
    for i in range(m):
        parts = {
            n: encode(_x(math.prod(s), seed=10 + 7 * i + j, scale=1.0), codec)
            for j, (n, s) in enumerate(SHAPES.items())
        }
        answers.append({n: decode(parts[n], codec, SHAPES[n]) for n in SHAPES})
        encoded.append({n: EncodedTensor.check(parts[n], codec, SHAPES[n]) for n in SHAPES})
    return answers, encoded


@pytest.mark.parametrize("claim", ["true", "none", "wrong", "junk", "tiny", "huge"])
def test_claimed_norms_give_the_batch_merge_and_a_wrong_claim_is_corrected(claim):
    answers, encoded = _encoded_answers(4)
    weights = [1.0, 2.0, 0.5, 1.5]
    sums = RoundSums(SHAPES, method="rda", embedding_names=EMB)
    for i, (enc, w) in enumerate(zip(encoded, weights, strict=True)):
        claimed = {
            "true": {n: t.norm() for n, t in enc.items()},
            "none": None,
            "wrong": {n: 2.5 * t.norm() for n, t in enc.items()},
            "junk": {n: "x" for n in enc},
            "tiny": {n: 1e-30 for n in enc},  # would add 1e30 × the values before any correction
            "huge": {n: 1e30 for n in enc},
        }[claim]
        sums.add_encoded(str(i), w, enc, claimed)
    done = sums.finalize(lambda k: answers[int(k)])
    merged, stats = merge_with_stats(answers, weights, embedding_names=EMB, method="rda")
    for n, t in merged.items():  # to 1e-6 of the tensor's scale (fp32 summation order differs)
        torch.testing.assert_close(done.merged[n], t, rtol=1e-6, atol=1e-6 * float(t.abs().max()))
    assert done.stats["merged_norm"] == pytest.approx(stats["merged_norm"], rel=1e-6)
    # every RDA tensor of every answer took a second pass when (and only when) its claim was wrong
    assert sums.corrections == (4 * 2 if claim == "wrong" else 0)
    assert sums.unclaimed == (0 if claim in ("true", "wrong") else 4 * 2)
    assert all(bool(torch.isfinite(d).all()) for d in sums.directions.values())


def test_an_open_round_holds_one_sum_per_tensor():
    numel = sum(math.prod(s) for s in SHAPES.values())
    for method in ("rda", "mean"):
        assert RoundSums(SHAPES, method=method, embedding_names=EMB).nbytes() == 4 * numel


@pytest.mark.parametrize("codec", INT_CODECS)
def test_codes_in_the_padding_of_the_last_block_count_for_nothing(codec):
    n = 1000  # 7 full blocks and 104 values of an eighth
    parts = {k: v.clone() for k, v in encode(_x(n), codec).items()}
    bits = {"int8": 8, "int4": 4, "int2": 2}[codec]
    pad_bytes = (8 * BLOCK - n) * bits // 8
    parts["q"][-pad_bytes:] = 0  # code 0 is −L: the largest magnitude, in every padded slot
    ref = decode(parts, codec, (n,))
    t = EncodedTensor.check(parts, codec, (n,))
    acc = torch.zeros(n)
    assert t.accumulate(acc, 1.0) == pytest.approx(float(ref.double().norm()), rel=1e-7)
    torch.testing.assert_close(acc, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("codec", INT_CODECS)
def test_a_tensor_measured_by_a_reader_adds_the_same_without_measuring_again(codec):
    n = 3000
    t = EncodedTensor.check(encode(_x(n), codec), codec, (n,))
    m = t.measured()
    assert t.known_norm is None and m.known_norm == t.norm() and m.measured() is m
    a, b = torch.zeros(n), torch.zeros(n)
    assert m.accumulate(a, 0.5) == t.accumulate(b, 0.5)
    assert torch.equal(a, b)
