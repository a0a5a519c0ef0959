"""Compressed downloads (issue 16 item 5): the delta path against the full path, error feedback, refusals.

The syncer side runs through the real `GlobalFragment` + `SyncerFiles.publish` over a memory store; the
learner side through the real `VersionFeed` or the payload readers it uses.
"""

import math
import uuid
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.codec.blockwise import PACKING
from ddiloco.config.run import DilocoConfig
from ddiloco.learner.accel import HostCopier
from ddiloco.learner.sharded import LiveMembers
from ddiloco.learner.versions import VersionFeed
from ddiloco.protocol import signing, wire
from ddiloco.protocol.update import UpdateHeader
from ddiloco.protocol.wire import RunSigner
from ddiloco.run.downlink import apply_delta, digest, encode_step
from ddiloco.run.fragments import Fragment
from ddiloco.run.globalmodel import (
    Layout,
    pack_global,
    publish_global,
    read_global_delta,
    read_global_full,
)
from ddiloco.run.root import RunRoot
from ddiloco.store.memory import MemoryStore
from ddiloco.syncer.fragment import MergeRule
from ddiloco.syncer.rounds import Answer, Round
from ddiloco.syncer.state import SyncerFiles
from ddiloco.tracking.metrics import LearnerMetrics

RUN = "r"
KEY = signing.for_run(b"master-key" * 4, RUN)
SIGNER = RunSigner(RUN, KEY)
SHAPES = {"w": [3, 100], "b": [7]}  # 300 values: two full blocks of 128 and a padded one
LAYOUT = Layout(
    fragments=[Fragment(0, ("b", "w"), 307)], shapes=SHAPES, embedding_names=frozenset(), model={}
)
RULE = MergeRule(
    method="rda",
    outer_lr=0.7,
    outer_momentum=0.9,
    token_weighting=True,
    robust_clip=None,
    embedding_names=frozenset(),
)


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def last(run):
    *_, final = run
    return final


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def syncer_run(dtype: str, codec: str, versions: int, seed: int = 0):
    """A syncer publishing `versions` merges of two learners' random steps; yields after each commit."""
    store = MemoryStore(f"downlink-{uuid.uuid4().hex}")
    g = torch.Generator().manual_seed(seed)
    v0 = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    publish_global(store, SIGNER, 0, 0, v0, dtype)
    files = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT, dtype, codec)
    frag = files.resume(RULE, 0.0).fragments[0]
    for r in range(versions):
        header = UpdateHeader(base_version=frag.version, c_tokens=640, c_steps=10, c_seconds=1.0)
        answers = {
            f"{m}-0": Answer(
                f"{m}-0", header, {n: 1e-2 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
            )
            for m in range(2)
        }
        proposal = frag.propose(answers, RULE)
        files.publish(proposal, proposal.record(Round(r, 0, 0.0, 0.0), now=0.0, merged_at=0.0))
        frag.commit(proposal, published_at=0.0, clock=0.0)
        yield store, frag


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_delta_path_and_the_full_path_hold_bit_identical_values(dtype, codec):
    held = None
    for store, frag in syncer_run(dtype, codec, 100):
        v = frag.version
        full = read_global_full(store, SIGNER, LAYOUT, 0, v)
        if held is None:  # a learner that joined at version 0
            held = read_global_full(store, SIGNER, LAYOUT, 0, v - 1)
        delta = read_global_delta(store, SIGNER, LAYOUT, 0, v)
        assert (delta.base_version, delta.base_digest) == (held.version, held.digest)
        values = {n: apply_delta(held.tensors[n], d, dtype) for n, d in delta.deq.items()}
        for n in SHAPES:
            assert torch.equal(bits(values[n]), bits(full.tensors[n])), (v, n)
            assert torch.equal(bits(frag.base(v)[n]), bits(full.tensors[n]))  # answers' bases are L_v
        assert delta.digest == full.digest == digest(values, dtype)
        held = full
    assert not all(torch.equal(frag.theta[n], held.tensors[n]) for n in SHAPES)  # the master stays apart


def test_a_restarted_syncer_keeps_the_master_and_publishes_deltas_against_what_learners_hold():
    store, before = last(syncer_run("fp32", "int4", 6))
    files = SyncerFiles(RunRoot(store, RUN, KEY), LAYOUT, "fp32", "int4")
    after = files.resume(RULE, 0.0).fragments[0]
    assert all(torch.equal(after.theta[n], before.theta[n]) for n in SHAPES)  # the master, not L_v
    full = read_global_full(store, SIGNER, LAYOUT, 0, 6)
    assert all(torch.equal(after.base(6)[n], full.tensors[n]) for n in SHAPES)


def walk(versions: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Θ_v of an outer optimizer with momentum: correlated steps of ~1e-3 on values of ~1."""
    g = torch.Generator().manual_seed(seed)
    theta = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    mom = {n: torch.zeros(s) for n, s in SHAPES.items()}
    out = [theta]
    for _ in range(versions):
        for n, s in SHAPES.items():
            mom[n] = 0.9 * mom[n] + 1e-4 * torch.randn(s, generator=g)
        theta = {n: theta[n] + mom[n] for n in SHAPES}
        out.append(theta)
    return out


def block_scales(parts: dict[str, torch.Tensor], name: str, numel: int) -> torch.Tensor:
    """The quantization step of every element of `name` (its block's scale), shape (numel,)."""
    return parts[f"{name}/scale"].repeat_interleave(128)[:numel]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_error_feedback_keeps_learners_within_one_quantization_step_of_the_master(dtype, codec):
    thetas = walk(200)
    eps = 2.0**-24 if dtype == "fp32" else 2.0**-8  # half an ulp, relative
    held = {n: t.to(torch.bfloat16).float() if dtype == "bf16" else t for n, t in thetas[0].items()}
    plain = dict(held)  # without error feedback: deltas of Θ_v − Θ_{v−1} added to what learners hold
    drift_plain, worst = [], 0.0
    for prev, theta in zip(thetas, thetas[1:], strict=False):
        step = encode_step(held, theta, codec, dtype)
        held = step.values
        for n in SHAPES:
            err = (theta[n] - held[n]).abs().reshape(-1)
            one_step = block_scales(step.parts, n, err.numel())
            bound = one_step / 2 + eps * (theta[n].abs().reshape(-1) + one_step) + 1e-12
            assert bool((err <= bound).all()), (n, float((err - bound).max()))
            worst = max(worst, float(err.max()))
        naive = encode_step({n: prev[n] for n in SHAPES}, theta, codec, "fp32")
        deq = {n: naive.values[n] - prev[n] for n in SHAPES}  # deq(Q(Θ_v − Θ_{v−1})) up to fp32 rounding
        plain = {n: apply_delta(plain[n], deq[n], dtype) for n in SHAPES}
        drift_plain.append(max(float((theta[n] - plain[n]).abs().max()) for n in SHAPES))
    # Without error feedback the quantization errors add up: the drift grows with the number of versions,
    # well past the largest error with error feedback over the whole run.
    assert drift_plain[-1] > 4 * drift_plain[9]
    assert drift_plain[-1] > 3 * worst, (drift_plain[-1], worst)


def feed(store: MemoryStore, codec: str = "int8") -> VersionFeed:
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    return VersionFeed(
        RunRoot(store, RUN, KEY),
        LAYOUT,
        LiveMembers(params),
        HostCopier(torch.device("cpu")),
        LearnerMetrics(CollectorRegistry(), 0, 0),
        DilocoConfig(download_codec=codec),
        learner_id=0,
    )


def fetch(f: VersionFeed, version: int) -> list:
    with ThreadPoolExecutor(1) as pool:
        f.request(pool, 0, version)
        wait(list(f.downloads.values()))
        return list(f.collect(lambda p: True))


def test_a_learner_one_version_behind_downloads_the_delta_and_holds_the_full_values():
    store, _ = last(syncer_run("bf16", "int4", 3))
    f = feed(store)
    f.overwrite(0, f.first(0, 0), 0.0)
    for v in (1, 2, 3):
        [(p, got)] = fetch(f, v)
        f.overwrite(p, got, 0.0)
        full = read_global_full(store, SIGNER, LAYOUT, 0, v)
        assert all(torch.equal(bits(f.anchors[n]), bits(full.tensors[n])) for n in SHAPES)
        assert f.held[0] == (v, full.digest)
    assert f.fetched == {"delta": 3} and not f.rejected_globals


def test_a_delta_on_another_base_is_refused_and_the_full_version_fetched():
    store, _ = last(syncer_run("fp32", "int8", 2))
    f = feed(store)
    f.overwrite(0, f.first(0, 0), 0.0)
    f.held[0] = (0, "0" * 64)  # version 0, but not the values the syncer published as version 0
    before = {n: t.clone() for n, t in f.anchors.items()}
    assert fetch(f, 1) == []  # downloaded, refused, never applied
    assert f.rejected_globals == {"base_mismatch": 1} and f.fetched == {"delta": 1}
    assert all(torch.equal(f.anchors[n], before[n]) for n in SHAPES)
    [(_, got)] = fetch(f, 1)  # the next request takes the full version
    assert f.fetched == {"delta": 1, "full": 1}
    full = read_global_full(store, SIGNER, LAYOUT, 0, 1)
    assert got.digest == full.digest and all(torch.equal(got.tensors[n], full.tensors[n]) for n in SHAPES)


@pytest.mark.parametrize(
    "forge, reason",
    [
        ("other_key", "delta_bad_signature"),
        ("other_version", "delta_mismatch"),
        ("altered", "delta_checksum"),
    ],
)
def test_a_forged_delta_is_refused_and_the_full_version_fetched(forge, reason):
    store, _ = last(syncer_run("fp32", "int8", 2))
    blob = store.get(keys.global_delta_key(0, 1))
    payload = wire.unpack(blob, key=KEY)
    if forge == "other_key":  # same content, signed by someone without the run key
        other = signing.for_run(b"not-the-key!" * 4, RUN)
        blob = wire.pack(payload.tensors, payload.meta, key=other)
    elif forge == "other_version":  # a genuine delta (of v2) put where v1's belongs
        blob = store.get(keys.global_delta_key(0, 2))
    else:  # one code flipped after signing
        blob = bytearray(blob)
        blob[-200] ^= 0xFF
        blob = bytes(blob)
    store.put(keys.global_delta_key(0, 1), blob)
    f = feed(store)
    f.overwrite(0, f.first(0, 0), 0.0)
    [(_, got)] = fetch(f, 1)
    assert f.rejected_globals == {reason: 1} and f.fetched == {"full": 1}
    full = read_global_full(store, SIGNER, LAYOUT, 0, 1)
    assert got.digest == full.digest and all(torch.equal(got.tensors[n], full.tensors[n]) for n in SHAPES)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_syncers_in_place_step_equals_the_plain_one_bit_for_bit(dtype, codec):
    """Publish gives up the L_{v−1} it read (summed into in place) and lends a pooled scratch buffer: the
    parts and L_v must be exactly those of `encode_step` on fresh memory."""
    thetas = walk(3)
    held = {n: t.to(torch.bfloat16).float() if dtype == "bf16" else t.clone() for n, t in thetas[1].items()}
    plain = encode_step(held, thetas[2], codec, dtype)
    scratch = torch.full((sum(math.prod(s) for s in SHAPES.values()),), float("nan"))
    own = {n: t.clone() for n, t in held.items()}
    fast = encode_step(own, thetas[2], codec, dtype, scratch=scratch)
    assert plain.parts.keys() == fast.parts.keys()
    assert all(torch.equal(plain.parts[k], fast.parts[k]) for k in plain.parts)
    assert all(torch.equal(bits(plain.values[n]), bits(fast.values[n])) for n in SHAPES)
    assert all(
        torch.equal(held[n], thetas[1][n].to(torch.bfloat16).float() if dtype == "bf16" else thetas[1][n])
        for n in SHAPES
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_global_packed_with_the_digest_publish_computed_is_the_same_payload(dtype):
    """Publish hashes a version's values once (the delta names the digest) and hands it to `pack_global`:
    the payload must be byte-identical to one hashed in `wire.pack`, and a wrong digest must not verify."""
    values = {n: torch.randn(s, generator=torch.Generator().manual_seed(3)) for n, s in SHAPES.items()}
    plain = pack_global(SIGNER, 0, 4, values, dtype, {"round": 9})
    assert pack_global(SIGNER, 0, 4, values, dtype, {"round": 9}, digest=digest(values, dtype)) == plain
    wrong = pack_global(SIGNER, 0, 4, values, dtype, {"round": 9}, digest="0" * 64)
    with pytest.raises(wire.PayloadError, match="checksum"):
        wire.unpack(wrong, key=KEY)


@pytest.mark.parametrize("packing", [None, "interleaved"])
def test_an_int4_delta_of_another_packing_is_refused_by_name_and_the_full_version_fetched(packing):
    """int4 codes of another layout decode to plausible wrong values: the header names the packing and a
    reader refuses any other (`validation.packing`), whatever the signature says."""
    store, _ = last(syncer_run("fp32", "int4", 2))
    payload = wire.unpack(store.get(keys.global_delta_key(0, 1)), key=KEY)
    assert payload.meta["packing"] == PACKING
    meta = {k: v for k, v in payload.meta.items() if k != "packing"}
    if packing is not None:
        meta["packing"] = packing
    store.put(keys.global_delta_key(0, 1), wire.pack(payload.tensors, meta, key=KEY))
    with pytest.raises(wire.PayloadError, match="int4 codes packed .*same ddiloco version"):
        read_global_delta(store, SIGNER, LAYOUT, 0, 1)
    f = feed(store, "int4")
    f.overwrite(0, f.first(0, 0), 0.0)
    [(_, got)] = fetch(f, 1)
    assert f.rejected_globals == {"delta_bad_codec": 1} and f.fetched == {"full": 1}
    full = read_global_full(store, SIGNER, LAYOUT, 0, 1)
    assert got.digest == full.digest


def test_download_codec_none_publishes_no_delta_and_the_rounded_master():
    store, frag = last(syncer_run("bf16", "none", 2))
    assert not store.exists(keys.global_delta_key(0, 1))
    full = read_global_full(store, SIGNER, LAYOUT, 0, 2)
    assert all(torch.equal(full.tensors[n], frag.theta[n].to(torch.bfloat16).float()) for n in SHAPES)
    f = feed(store, codec="none")
    f.overwrite(0, f.first(0, 1), 0.0)
    [(_, got)] = fetch(f, 2)
    assert f.fetched == {"full": 1} and got.digest == full.digest
