"""Upload codecs: round-trip error bounds, wire layout, sizes, and rejection of malformed payloads."""

import pytest
import torch
from safetensors.torch import load, save

from ddiloco.codec.base import BLOCK, all_finite
from ddiloco.codec.blockwise import PACKING
from ddiloco.codec.registry import CODECS, decode, encode, encoded_nbytes

INT_CODECS = ("int8", "int4", "int2")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the machine is shared; conftest does the same for full runs


def make(kind: str, numel: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(numel, generator=g) * 1e-3
    if kind == "heavy":  # Cauchy: a few huge values per block, most tiny
        return torch.randn(numel, generator=g) / torch.randn(numel, generator=g)
    if kind == "multiscale":  # magnitudes from 1e-30 to 1e3, so every block has its own scale
        return (
            torch.randn(numel, generator=g)
            * 10 ** (torch.rand(numel // BLOCK + 1, generator=g) * 33 - 30).repeat_interleave(BLOCK)[:numel]
        )
    if kind == "zero":
        return torch.zeros(numel)
    raise AssertionError(kind)


@pytest.mark.parametrize("codec", INT_CODECS)
@pytest.mark.parametrize("kind", ["normal", "heavy", "multiscale", "zero"])
@pytest.mark.parametrize(
    "numel", [1, 128, 1000, 600_001]
)  # 1000 and 600_001 are padded; 600_001 spans chunks
def test_int_roundtrip_within_half_a_step(codec: str, kind: str, numel: int) -> None:
    x = make(kind, numel)
    parts = encode(x, codec)
    y = decode(parts, codec, [numel])
    assert y.dtype == torch.float32 and y.shape == x.shape
    scale = parts["scale"].repeat_interleave(BLOCK)[:numel]  # (numel,) the step of each value's block
    # half a step, plus a few ulps for the division and the multiply
    assert bool(((y - x).abs() <= scale * 0.5 * (1 + 1e-5) + 1e-38).all())
    if kind == "zero":
        assert torch.equal(parts["scale"], torch.zeros_like(parts["scale"])) and torch.equal(y, x)


def test_int2_is_ternary() -> None:
    x = make("normal", 4 * BLOCK)
    parts = encode(x, "int2")
    y = decode(parts, "int2", [x.numel()]).view(-1, BLOCK)
    s = parts["scale"][:, None]
    assert bool(((y == 0) | (y == s) | (y == -s)).all())


def test_fp32_exact_bf16_within_epsilon() -> None:
    x = make("heavy", 1000).view(10, 100)
    assert torch.equal(decode(encode(x, "fp32"), "fp32", [10, 100]), x)
    y = decode(encode(x, "bf16"), "bf16", [10, 100])
    assert bool(((y - x).abs() <= x.abs() * 2**-8).all())  # round-to-nearest: half of bf16's 2**-7


def test_wire_layout_is_stable() -> None:
    """Offset-binary codes (code + L), block-planar (byte j: codes j, j + BLOCK / per byte, ..., low bits
    first); a change here breaks learners of another version, so it also changes `PACKING`."""
    assert PACKING == "block-planar"
    x = torch.zeros(BLOCK)
    x[:4] = torch.tensor([1.0, -1.0, 0.3, 0.0])
    x[64] = -1.0
    p4 = encode(x, "int4")  # scale 1/7: codes 7, -7, 2, 0 -> stored 14, 0, 9, 7; code 64 stored 0, rest 7
    assert p4["q"][:4].tolist() == [14 | 0 << 4, 0 | 7 << 4, 9 | 7 << 4, 7 | 7 << 4]
    p2 = encode(x, "int2")  # scale 1: codes 1, -1, 0, 0 -> stored 2, 0, 1, 1; code 64 stored 0, rest 1
    assert p2["q"][:3].tolist() == [2 | 1 << 2 | 0 << 4 | 1 << 6, 0 | 1 << 2 | 1 << 4 | 1 << 6, 0b01010101]
    p8 = encode(x, "int8")  # scale 1/127: codes 127, -127, 38, 0
    assert p8["q"][:4].tolist() == [254, 0, 127 + 38, 127]
    assert p8["scale"].tolist() == pytest.approx([1 / 127])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [0, 1, 127, 128, 129, 4096, 70_001])
def test_sizes_match_encoded_nbytes_and_safetensors(codec: str, numel: int) -> None:
    x = make("normal", numel)
    parts = encode(x, codec)
    assert sum(t.numel() * t.element_size() for t in parts.values()) == encoded_nbytes(numel, codec)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in parts.values())
    back = load(save(parts))  # ready for safetensors as is
    assert torch.equal(decode(back, codec, [numel]), decode(parts, codec, [numel]))


def test_encoded_nbytes_values() -> None:
    assert encoded_nbytes(256, "int4") == 128 + 8
    assert encoded_nbytes(129, "int2") == 2 * 32 + 8
    assert encoded_nbytes(10, "bf16") == 20 and encoded_nbytes(10, "fp32") == 40


@pytest.mark.parametrize("codec", CODECS)
def test_decode_into_out_and_noncontiguous_input(codec: str) -> None:
    x = make("heavy", 300 * 7).view(300, 7).t()  # (7, 300), not contiguous
    ref = decode(encode(x.contiguous(), codec), codec, [7, 300])
    out = torch.full((7, 300), float("nan"))
    assert decode(encode(x, codec), codec, (7, 300), out=out) is out
    assert torch.equal(out, ref)


@pytest.mark.parametrize("codec", CODECS)
def test_encode_refuses_non_finite(codec: str) -> None:
    for bad in (float("nan"), float("inf")):
        x = make("normal", 300)
        x[257] = bad
        with pytest.raises(ValueError, match="NaN/Inf"):
            encode(x, codec)


def test_unknown_codec_and_bad_block() -> None:
    with pytest.raises(ValueError, match="fp32, bf16, int8, int4, int2"):
        encode(torch.zeros(4), "fp8")
    with pytest.raises(ValueError, match="expected one of"):
        decode({}, "int3", [4])
    with pytest.raises(ValueError, match="multiple of 4"):
        encode(torch.zeros(4), "int2", block=130)
    with pytest.raises(ValueError, match="floating-point"):
        encode(torch.zeros(4, dtype=torch.int32), "int8")


def _bad(parts: dict, **changes) -> dict:
    out = dict(parts)
    for k, v in changes.items():
        if v is None:
            del out[k]
        else:
            out[k] = v
    return out


def _malformed() -> list[tuple[str, dict, str, list[int], str]]:
    x = make("normal", 1000)
    p8, p4, p2 = (encode(x, c) for c in INT_CODECS)
    q4, s4 = p4["q"], p4["scale"]
    nan_scale = s4.clone()
    nan_scale[3] = float("nan")
    neg_scale = s4.clone()
    neg_scale[0] = -1.0
    bad8, bad4, bad2 = p8["q"].clone(), q4.clone(), p2["q"].clone()
    bad8[5], bad4[5], bad2[5] = 255, 0xF0, 0b11
    nan_data = x.clone()
    nan_data[9] = float("nan")
    return [
        ("q wrong dtype", _bad(p4, q=q4.view(torch.int8)), "int4", [1000], "dtype"),
        ("scale wrong dtype", _bad(p4, scale=s4.double()), "int4", [1000], "dtype"),
        ("truncated q", _bad(p4, q=q4[:-1]), "int4", [1000], "shape"),
        ("q too long", _bad(p4, q=torch.cat([q4, q4[:64]])), "int4", [1000], "shape"),
        ("q 2-d", _bad(p4, q=q4.view(8, -1)), "int4", [1000], "shape"),
        ("missing scale", _bad(p4, scale=None), "int4", [1000], "keys"),
        ("extra key", _bad(p4, data=x), "int4", [1000], "keys"),
        ("NaN scale", _bad(p4, scale=nan_scale), "int4", [1000], "NaN/Inf"),
        (
            "Inf scale",
            _bad(p4, scale=nan_scale.nan_to_num(posinf=0, nan=float("inf"))),
            "int4",
            [1000],
            "NaN/Inf",
        ),
        ("negative scale", _bad(p4, scale=neg_scale), "int4", [1000], "negative"),
        ("wrong shape", p4, "int4", [1001 + BLOCK], "shape"),
        ("negative dim", p4, "int4", [-1000], "non-negative"),
        ("int8 code 255", _bad(p8, q=bad8), "int8", [1000], "out of range"),
        ("int4 nibble 15", _bad(p4, q=bad4), "int4", [1000], "out of range"),
        ("int2 code 3", _bad(p2, q=bad2), "int2", [1000], "out of range"),
        ("not a tensor", _bad(p4, q=q4.tolist()), "int4", [1000], "expected a tensor"),
        ("fp32 NaN data", {"data": nan_data}, "fp32", [1000], "NaN/Inf"),
        ("fp32 short data", {"data": x[:999]}, "fp32", [1000], "shape"),
        ("bf16 given fp32", {"data": x}, "bf16", [1000], "dtype"),
        ("fp32 given codes", p8, "fp32", [1000], "keys"),
    ]


@pytest.mark.parametrize("case", _malformed(), ids=lambda c: c[0])
def test_decode_rejects_malformed(case) -> None:
    _, parts, codec, shape, msg = case
    with pytest.raises(ValueError, match=msg):
        decode(parts, codec, shape)


def test_decode_rejects_bad_out_and_non_mapping() -> None:
    parts = encode(torch.ones(10), "int8")
    with pytest.raises(ValueError, match="out must be"):
        decode(parts, "int8", [10], out=torch.empty(11))
    with pytest.raises(ValueError, match="mapping"):
        decode([parts["q"], parts["scale"]], "int8", [10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_finite_is_exact_without_a_tensor_sized_mask(dtype) -> None:
    """One sum decides the common case; a finite tensor whose sum overflows must still be finite (a false
    alarm would refuse a valid global), and NaN/Inf anywhere, even in the last chunk, must be found."""
    x = torch.ones(3 * (1 << 19) + 5, dtype=dtype)
    assert all_finite(x) and all_finite(x[:0])
    big = torch.full((1000,), 3e38, dtype=dtype)  # sum overflows to inf, every value finite
    assert not bool(torch.isfinite(big.sum())) and all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[-1] = bad
        assert not all_finite(y)
