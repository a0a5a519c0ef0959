"""The global model in the store: fragment layout, published versions, and assembling a full model.

These are primitives, given the run's `wire.RunSigner` by whoever holds the run root (`ddiloco.run.root.RunRoot`,
the learner's version feed, the syncer's files). The layout (fragments, shapes, embedding-like names, model
config) is written once by `prepare` next to global version 0, so learners and the syncer agree without
talking; it speaks of members, with `pieces` for the row ranges of split tensors (`members`, `assemble`). A
version is a write-once payload `global/{p}/v{n}` (fp32 or bf16) followed by its `latest.json` pointer, and
with a download codec also a write-once delta `global/{p}/d{v}` against v − 1. Readers verify run id, kind,
fragment, version, names, shapes and, with the run key, the writer's signature, and reads are capped at the
size the layout allows.

Design notes: docs/internals.md, "The global model in the store".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ddiloco import keys
from ddiloco.codec import registry
from ddiloco.codec.base import all_finite
from ddiloco.codec.blockwise import PACKING
from ddiloco.model.gpt import GPT, GPTConfig, gpt_config, init_model
from ddiloco.protocol import wire
from ddiloco.protocol.validation import packing
from ddiloco.run.downlink import DeltaStep, decode_delta
from ddiloco.run.fragments import Fragment, Piece, balanced
from ddiloco.store.base import ObjectTooLarge, Store
from ddiloco.store.blob import Blob, Lend

log = logging.getLogger(__name__)

MAX_FRAGMENT_BYTES = 16 << 30
"""Upper bound for callers without a layout; readers with one use `fragment_max_bytes`."""
HEADER_SLACK = 1 << 20
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(slots=True)
class Layout:
    fragments: list[Fragment]
    shapes: dict[str, list[int]]
    """Shape of every member (whole tensor or piece), by member name."""
    embedding_names: frozenset[str]
    """Members merged by the plain mean (token/position embeddings, LM head, and their pieces)."""
    model: dict[str, Any]
    pieces: dict[str, Piece] = field(default_factory=dict)
    """Piece member name -> the rows of the tensor it holds; empty when every member is a whole tensor."""

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_bytes(self) -> list[int]:
        return [f.numel * 4 for f in self.fragments]

    def fragment_max_bytes(self, p: int) -> int:
        """Largest legitimate payload of fragment p: fp32 values plus a generous header allowance."""
        frag = self.fragments[p]
        return 4 * frag.numel + HEADER_SLACK + 512 * len(frag.names)

    def model_max_bytes(self) -> int:
        return 4 * sum(f.numel for f in self.fragments) + HEADER_SLACK + 512 * len(self.shapes)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(**self.model)

    def members(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Member name -> tensor, from whole tensors by parameter name: a whole tensor as given, a piece as
        a view of its rows (contiguous when the tensor is), so `copy_` into it writes the tensor."""
        out: dict[str, torch.Tensor] = {}
        for frag in self.fragments:
            for name in frag.names:
                pc = self.pieces.get(name)
                if pc is None:
                    out[name] = tensors[name]
                else:
                    out[name] = tensors[pc.tensor].detach().narrow(0, pc.start, pc.stop - pc.start)
        return out

    def assemble(self, members: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Parameter name -> whole tensor, from every member's tensor (pieces concatenated by rows)."""
        out = {n: t for n, t in members.items() if n not in self.pieces}
        rows: dict[str, list[Piece]] = {}
        for pc in self.pieces.values():
            rows.setdefault(pc.tensor, []).append(pc)
        for tensor, pcs in sorted(rows.items()):
            pcs.sort(key=lambda pc: pc.start)
            if [pc.start for pc in pcs] != [0] + [pc.stop for pc in pcs[:-1]]:
                raise ValueError(f"the layout's pieces of {tensor!r} do not tile its rows")
            out[tensor] = torch.cat([members[pc.name] for pc in pcs], dim=0)
        return out

    def to_json(self) -> dict[str, Any]:
        out = {
            "fragments": [
                {"fragment_id": f.fragment_id, "names": list(f.names), "numel": f.numel}
                for f in self.fragments
            ],
            "shapes": self.shapes,
            "embedding_names": sorted(self.embedding_names),
            "model": self.model,
        }
        if self.pieces:  # a whole-tensor layout has no `pieces` key
            out["pieces"] = {n: [pc.tensor, pc.start, pc.stop] for n, pc in sorted(self.pieces.items())}
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Layout:
        return cls(
            fragments=[Fragment(f["fragment_id"], tuple(f["names"]), f["numel"]) for f in d["fragments"]],
            shapes={k: list(v) for k, v in d["shapes"].items()},
            embedding_names=frozenset(d["embedding_names"]),
            model=d["model"],
            pieces={n: Piece(str(t), int(a), int(b)) for n, (t, a, b) in d.get("pieces", {}).items()},
        )


def model_config_from_run(cfg: Any, vocab_size: int) -> GPTConfig:
    m = cfg.model
    return gpt_config(
        m.preset,
        vocab_size=vocab_size,
        block_size=m.seq_len,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
    )


def make_layout(model: GPT, num_fragments: int) -> Layout:
    """The model's layout at P = `num_fragments` (parameter shapes only: a meta-device model will do)."""
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    fragments, pieces = balanced(shapes, num_fragments)
    member_shapes = {n: s for n, s in shapes.items() if n not in {pc.tensor for pc in pieces.values()}}
    member_shapes |= {n: [pc.stop - pc.start, *shapes[pc.tensor][1:]] for n, pc in pieces.items()}
    embeddings = model.embedding_names()
    return Layout(
        fragments=fragments,
        shapes={n: member_shapes[n] for f in fragments for n in f.names} if pieces else shapes,
        embedding_names=frozenset(embeddings | {n for n, pc in pieces.items() if pc.tensor in embeddings}),
        model=dataclasses.asdict(model.config)
        if dataclasses.is_dataclass(model.config)
        else dict(model.config),
        pieces=pieces,
    )


def read_layout(store: Store) -> Layout:
    return Layout.from_json(store.get_json(keys.LAYOUT))


def build_model(layout: Layout, seed: int = 0, device: torch.device | str = "cpu") -> GPT:
    """The layout's model, freshly initialised: the built-in GPT, or a Hugging Face model (`ddiloco.model.hf`)."""
    from ddiloco.model.hf.model import HFSpec, init_hf, is_hf

    if is_hf(layout.model):
        return init_hf(HFSpec(**layout.model), seed, device)  # type: ignore[return-value]
    return init_model(layout.gpt_config(), seed, device)


def publish_global(store: Store, signer: wire.RunSigner, p: int, version: int, *payload: Any) -> int:
    """Write global version `version` of fragment p (signed with the run key, if any), then its latest
    pointer; `payload`: `pack_global_blob`'s tensors, dtype and extra. Returns bytes written. (The syncer
    creates versions write-once instead: `ddiloco.syncer.state`.)"""
    blob = pack_global_blob(signer, p, version, *payload)
    store.put(keys.global_key(p, version), blob)
    put_latest(store, p, version)
    return len(blob)


def pack_global(*args: Any, **kwargs: Any) -> bytes:
    """`pack_global_blob` (same arguments) joined into one bytes object."""
    return bytes(pack_global_blob(*args, **kwargs))


def pack_global_blob(
    signer: wire.RunSigner,
    p: int,
    version: int,
    tensors: dict[str, torch.Tensor],
    dtype: str,
    extra: dict | None = None,
    *,
    digest: str | None = None,
) -> Blob:
    """The payload of global version `version` of fragment p in `dtype`, its header extended by `extra`, as
    a `Blob` that borrows the tensors' memory where they are already in `dtype`. `digest`:
    `ddiloco.run.downlink.digest(tensors, dtype)` when the caller computed it already (not rehashed)."""
    tdtype = _DTYPES[dtype]
    return signer.pack_blob(
        {n: t.detach().to(tdtype) for n, t in tensors.items()},
        {"kind": "global", "fragment_id": p, "version": version, **(extra or {})},
        data_sha256=digest,
    )


def put_latest(store: Store, p: int, version: int) -> None:
    """Point fragment p's `latest` pointer at `version` (written after the version itself)."""
    store.put_json(keys.global_latest_key(p), {"version": version, "key": keys.global_key(p, version)})


def published_values(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """What a reader of `tensors` published as `dtype` gets back (fp32 copies, rounded once for bf16)."""
    tdtype = _DTYPES[dtype]
    return {
        n: t.detach().to(tdtype).float() if tdtype != torch.float32 else t.clone() for n, t in tensors.items()
    }


def latest_version(store: Store, p: int) -> int | None:
    """The version the `latest` pointer of fragment p names; None if there is none yet. The pointer is plain
    JSON (unsigned): it only says where to look, and whatever it names is verified when read."""
    d = store.get_json_or_none(keys.global_latest_key(p), max_bytes=4096)
    if d is None:
        return None
    v = d.get("version") if isinstance(d, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise wire.PayloadError("malformed", f"{keys.global_latest_key(p)} names no version ({str(d)[:80]})")
    return v


@dataclass(frozen=True, slots=True)
class Received:
    """A verified global version of one fragment as a reader got it: fp32 `tensors`, the SHA-256 of the
    values as the full payload stores them (`digest`, what a delta's base names), and the object's size."""

    version: int
    tensors: dict[str, torch.Tensor]
    digest: str
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)
    """The payload's verified header (a version the syncer published names its `round` and `epoch`)."""


@dataclass(frozen=True, slots=True)
class GlobalDelta:
    """A verified download delta of version `version` (`ddiloco.run.downlink`): `deq` (fp32) applies to the values
    of `base_version` whose digest is `base_digest`, and gives the values whose digest is `digest`."""

    version: int
    base_version: int
    base_digest: str
    digest: str
    dtype: str
    """The global dtype the sum is rounded to (`ddiloco.run.downlink.apply_delta`)."""
    deq: dict[str, torch.Tensor]
    nbytes: int


def read_global(
    store: Store, signer: wire.RunSigner, layout: Layout, p: int, version: int
) -> dict[str, torch.Tensor]:
    """Read and verify global version `version` of fragment p; tensors come back as fp32.

    Raises `wire.PayloadError` for anything unacceptable (an oversized object is `too_large`)."""
    return read_global_full(store, signer, layout, p, version).tensors


def read_global_full(
    store: Store,
    signer: wire.RunSigner,
    layout: Layout,
    p: int,
    version: int,
    *,
    lend: Lend | None = None,
) -> Received:
    """`read_global`, with the payload's digest and size (what a learner needs to take deltas after it).
    `lend`: read into memory the caller lends (`Store.get_into`); fp32 tensors then are views of it."""
    gkey, cap = keys.global_key(p, version), layout.fragment_max_bytes(p)
    if lend is None:
        blob: bytes | memoryview = get_capped(store, gkey, cap)
    else:
        try:
            blob = store.get_into(gkey, lend, max_bytes=cap)
        except ObjectTooLarge as e:
            raise wire.PayloadError("too_large", str(e)) from None
    payload = signer.unpack(
        blob, {"kind": "global", "fragment_id": p, "version": version}, borrow=lend is not None
    )
    frag = layout.fragments[p]
    if set(payload.tensors) != set(frag.names):
        raise wire.PayloadError(
            "wrong_shape", f"global v{version} of fragment {p} has the wrong tensor names"
        )
    out = {}
    for name, t in payload.tensors.items():
        if list(t.shape) != layout.shapes[name]:
            raise wire.PayloadError("wrong_shape", f"global tensor {name} has shape {list(t.shape)}")
        if t.dtype not in _DTYPES.values():
            raise wire.PayloadError("wrong_dtype", f"global tensor {name} has dtype {t.dtype}")
        out[name] = t.float()
        if not all_finite(out[name]):
            raise wire.PayloadError("non_finite", f"global tensor {name} has NaN/Inf")
    return Received(version, out, str(payload.meta["sha256"]), len(blob), payload.meta)


def pack_global_delta(
    signer: wire.RunSigner,
    p: int,
    version: int,
    step: DeltaStep,
    *,
    codec: str,
    dtype: str,
    base_digest: str,
    digest: str,
) -> Blob:
    """The payload of the download delta of version `version` of fragment p against version − 1, whose values
    have `base_digest` (the result has `digest`), signed with the run key, as a `Blob` of the parts' own
    memory. The syncer creates it write-once (`ddiloco.syncer.state`)."""
    meta = {
        "kind": "global_delta",
        "fragment_id": p,
        "version": version,
        "base_version": version - 1,
        "codec": codec,
        "packing": PACKING,
        "dtype": dtype,
        "base_sha256": base_digest,
        "values_sha256": digest,
    }
    return signer.pack_blob(step.parts, meta)


def read_global_delta(
    store: Store, signer: wire.RunSigner, layout: Layout, p: int, version: int
) -> GlobalDelta:
    """Read and verify the download delta of version `version` of fragment p (`PayloadError` otherwise)."""
    blob = get_capped(store, keys.global_delta_key(p, version), layout.fragment_max_bytes(p))
    payload = signer.unpack(
        blob,
        {"kind": "global_delta", "fragment_id": p, "version": version, "base_version": version - 1},
    )
    meta = payload.meta
    codec = meta.get("codec")
    if codec not in registry.names("download"):
        raise wire.PayloadError(
            "malformed", f"delta of fragment {p} v{version} has codec {str(codec)[:20]!r}"
        )
    packing(codec, meta.get("packing"), f"delta of fragment {p} v{version}")
    if meta.get("dtype") not in _DTYPES:
        raise wire.PayloadError("wrong_dtype", f"delta of fragment {p} v{version} names no global dtype")
    if not all(isinstance(meta.get(f), str) for f in ("base_sha256", "values_sha256")):
        raise wire.PayloadError("malformed", f"delta of fragment {p} v{version} names no base digest")
    shapes = {n: layout.shapes[n] for n in layout.fragments[p].names}
    try:
        deq = decode_delta(payload.tensors, shapes, codec)
    except ValueError as e:
        raise wire.PayloadError("malformed", f"delta of fragment {p} v{version}: {e}") from None
    return GlobalDelta(
        version, version - 1, meta["base_sha256"], meta["values_sha256"], meta["dtype"], deq, len(blob)
    )


def get_capped(store: Store, key: str, max_bytes: int) -> bytes:
    """The object at `key`, refused as `PayloadError("too_large")` above `max_bytes` (one request either way)."""
    try:
        return store.get(key, max_bytes=max_bytes)
    except ObjectTooLarge as e:
        raise wire.PayloadError("too_large", str(e)) from None


def write_initial_globals(
    store: Store, signer: wire.RunSigner, model: GPT, layout: Layout, dtype: str
) -> None:
    """Global version 0 of every fragment, from the seeded init. Written once, before any learner starts."""
    store.put_json(keys.LAYOUT, layout.to_json())
    params = layout.members(dict(model.named_parameters()))
    for frag in layout.fragments:
        if latest_version(store, frag.fragment_id) is not None:
            continue
        publish_global(store, signer, frag.fragment_id, 0, {n: params[n] for n in frag.names}, dtype)
