"""The codec registry (`ddiloco.codec.registry`): a codec made known in a test, with no library file touched,
passes the config checks, travels the learners' and the syncer's path (uploads and download deltas) and is
sized by the bandwidth planner; the built-in codecs' bytes are pinned."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from ddiloco.codec import registry
from ddiloco.codec.base import Codec
from ddiloco.codec.float import FloatCodec
from ddiloco.errors import ConfigError
from ddiloco.learner.accel import HostSnapshot
from ddiloco.learner.io import pack_update
from ddiloco.learner.loop import Learner
from ddiloco.posttrain.summary import build_summary
from ddiloco.protocol import validation, wire
from ddiloco.run.downlink import decode_delta, encode_step
from ddiloco.run.globalmodel import read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.simulate import bandwidth as bw
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from ddiloco.syncer.merge.accumulate import RoundSums
from tests._harness import drive, tiny_config


@pytest.fixture
def fp16():
    """A test-only codec: the values in IEEE half precision, for uploads and download deltas."""
    codec = registry.register(FloatCodec("fp16", torch.float16, download=True))
    yield codec
    registry.unregister("fp16")


def test_the_built_in_codecs_by_name_and_role():
    assert registry.CODECS == registry.names("upload") == ("fp32", "bf16", "int8", "int4", "int2")
    assert registry.names("download") == ("int8", "int4", "int2")
    assert registry.download_choices() == ("none", "int8", "int4", "int2")
    assert registry.publishes_deltas("int8") and not registry.publishes_deltas(registry.NONE)
    assert all(isinstance(registry.get(n), Codec) for n in registry.names())
    with pytest.raises(ValueError, match="unknown codec 'fp8'; expected one of fp32, bf16, int8, int4, int2"):
        registry.get("fp8")
    with pytest.raises(ValueError, match="unknown download codec 'fp32'; expected one of int8, int4, int2"):
        registry.get("fp32", "download")
    with pytest.raises(ValueError, match="registered already"):
        registry.register(FloatCodec("bf16", torch.bfloat16))
    with pytest.raises(ValueError, match="registered already"):
        registry.register(FloatCodec(registry.NONE, torch.float16))


def test_config_accepts_a_codec_once_registered(fp16):
    cfg = tiny_config("fp16-config", "diloco.codec=fp16", "diloco.download_codec=fp16")
    cfg.validate()
    assert (cfg.diloco.codec, cfg.diloco.download_codec) == ("fp16", "fp16")
    registry.unregister("fp16")
    try:
        with pytest.raises(
            ConfigError, match="diloco.codec='fp16': choose one of fp32, bf16, int8, int4, int2"
        ):
            tiny_config("fp16-config", "diloco.codec=fp16")
    finally:
        registry.register(fp16)


SHAPES = {"w": (40, 33), "b": (300,)}


def _delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 1e-3 for n, s in SHAPES.items()}


def test_an_update_in_a_registered_codec_is_packed_checked_and_merged(fp16):
    """The learner's `pack_update`, then the syncer's checks and its merge of answers kept encoded."""
    signer = wire.RunSigner("fp16-run")
    header = {
        "kind": "update", "learner_id": 0, "incarnation": 0, "fragment_id": 0, "round": 3, "base_version": 1,
        "c_steps": 4, "c_tokens": 512, "c_seconds": 1.0, "inner_step": 40, "codec": "fp16",
    }  # fmt: skip
    deltas = [_delta(1), _delta(2)]
    sums = RoundSums(SHAPES, method="mean")
    for i, delta in enumerate(deltas):
        payload = signer.unpack(
            pack_update(HostSnapshot(delta, None), "fp16", header, signer), {"kind": "update"}
        )
        meta = validation.header_fields(payload.meta)
        validation.counters(meta, codec="fp16", tokens_per_step=128, latest_version=1)
        assert {n: p.dtype for n, p in payload.tensors.items()} == {
            "w/data": torch.float16,
            "b/data": torch.float16,
        }
        encoded = validation.check_delta(payload.tensors, meta.codec, list(SHAPES), SHAPES, measure=True)
        sums.add_encoded(str(i), 1.0, encoded, meta.norms)
        assert sums.unclaimed == sums.corrections == 0  # the learner's claimed norms were the syncer's
        decoded = validation.decode_delta(payload.tensors, meta.codec, list(SHAPES), SHAPES)
        for n, t in delta.items():
            assert torch.equal(decoded[n], t.half().float())
    merged = sums.finalize(lambda k: deltas[int(k)]).merged
    for n in SHAPES:
        want = (deltas[0][n].half().float() + deltas[1][n].half().float()) / 2
        torch.testing.assert_close(merged[n], want, rtol=1e-6, atol=1e-9)
    bad = {**payload.tensors, "w/data": payload.tensors["w/data"].float()}
    with pytest.raises(wire.PayloadError, match="fp16 needs torch.float16"):
        validation.check_delta(bad, "fp16", list(SHAPES), SHAPES)


def test_a_download_delta_in_a_registered_codec_round_trips(fp16):
    held = _delta(3)
    theta = {n: t + d for (n, t), d in zip(held.items(), _delta(4).values(), strict=True)}
    step = encode_step({n: t.clone() for n, t in held.items()}, theta, "fp16", "fp32")
    deq = decode_delta(step.parts, {n: list(s) for n, s in SHAPES.items()}, "fp16")
    for n in SHAPES:
        assert torch.equal(held[n] + deq[n], step.values[n])  # what a learner applies is what was published


def test_a_run_uploads_and_downloads_in_a_registered_codec(fp16):
    """prepare, the syncer and two learners in process (`tests._harness`), fp16 both ways."""
    store = open_store("memory://fp16-run")
    cfg = tiny_config("fp16-run", "diloco.codec=fp16", "diloco.download_codec=fp16")
    prepare(store, cfg)
    syncer = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(2)]
    for learner in learners:
        learner.start()
    drive(syncer, learners)
    s = build_summary(store)
    assert (s.status, s.codec, s.rejected_updates) == ("done", "fp16", {})
    layout = read_layout(store)
    for learner in learners:
        assert learner.feed.fetched["delta"] > 0 and not learner.feed.rejected_globals
        for p, (version, _) in learner.feed.held.items():
            held = RunRoot(store, cfg.run_id).read_global(layout, p, version)
            for n, t in held.items():  # bit for bit what the full version holds
                assert torch.equal(learner.feed.anchors[n].view(torch.int32), t.view(torch.int32))


def test_the_bandwidth_planner_sizes_a_registered_codec(fp16):
    net = bw.Network()
    assert net.bits_per_value("fp16") == net.bits_per_value("bf16") == 16
    work = bw.Workload(params=1e9, step_seconds=1.0)
    rows = {
        r.dtype: r.gbps for r in bw.bandwidth_table(work, [4], ["fp16", "bf16"]) if r.method == "decoupled"
    }
    assert rows["fp16"] == rows["bf16"] > 0
    assert fp16.nbytes(1000) == 2000


def _sha(parts: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(parts):
        t = parts[k].contiguous()
        h.update(k.encode())
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()[:16]


def _x(n: int, seed: int = 0, scale: float = 1e-3) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


PINNED = {  # sha256 prefixes of encodings of _x(n), computed with ddiloco.compression before ddiloco.codec
    ("fp32", 1_000): "323ed9508bba9648",
    ("fp32", 600_001): "4fee04cb6cfa0d89",
    ("bf16", 1_000): "f0d05dd30cab7670",
    ("bf16", 600_001): "3503c740837c156c",
    ("int8", 1_000): "0c3435560e505188",
    ("int8", 600_001): "085beeac3213c2a0",
    ("int4", 1_000): "289b22af69efd76c",
    ("int4", 600_001): "c1268a1bf192e3fa",
    ("int2", 1_000): "5fc8c572d19f751e",
    ("int2", 600_001): "0faba133d037dc39",
}


@pytest.mark.parametrize(("codec", "n"), sorted(PINNED))
def test_the_stored_bytes_of_the_built_in_codecs_are_pinned(codec, n):
    parts = registry.encode(_x(n), codec)
    assert _sha(parts) == PINNED[codec, n]
    assert registry.encoded_nbytes(n, codec) == sum(t.numel() * t.element_size() for t in parts.values())
    assert math.isfinite(float(registry.decode(parts, codec, [n]).sum()))


DOWNLOAD_PINNED = {  # (parts, values) of a download step, computed as PINNED
    ("int8", "fp32"): "5b05f3a9849fc3c8 f9148f8aac30102d",
    ("int8", "bf16"): "5b05f3a9849fc3c8 fdaeb7b6031f3314",
    ("int4", "fp32"): "3fbb78f2aea4d6a8 7a4d667c8f94cfa0",
    ("int4", "bf16"): "3fbb78f2aea4d6a8 9af907eeaa38ddc8",
    ("int2", "fp32"): "6686e1c9b3dffab4 821a4c5ea3787d83",
    ("int2", "bf16"): "6686e1c9b3dffab4 cf5cb8e1d2523c7b",
}


@pytest.mark.parametrize(("codec", "dtype"), sorted(DOWNLOAD_PINNED))
def test_the_bytes_of_download_deltas_are_pinned(codec, dtype):
    shapes = {"a": (300, 7), "b": (1000,)}
    held = {k: _x(math.prod(s), 3).view(s) for k, s in shapes.items()}
    theta = {k: held[k] + _x(math.prod(s), 4, 1e-2).view(s) for k, s in shapes.items()}
    step = encode_step({k: v.clone() for k, v in held.items()}, theta, codec, dtype)
    assert f"{_sha(step.parts)} {_sha(step.values)}" == DOWNLOAD_PINNED[codec, dtype]
