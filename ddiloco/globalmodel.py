"""The global model in the store: fragment layout, published versions, and assembling a full model.

Design choices:
- These are the primitives; `ddiloco.run.RunRoot` calls them with its run id and key (the learner and the
  syncer still call them directly).
- The layout (which tensor is in which fragment, shapes, embedding-like names, model config) is written
  once by `prepare` next to global version 0, so learners and the syncer agree on it without talking.
- A global version is a write-once payload `global/{p}/v{n}`; the small `latest.json` pointer is written
  after it. Readers verify run id, kind, fragment, version, names and shapes before using a payload.
- With the run key (`ddiloco.protocol.signing.for_run`) every global version is signed by its writer (prepare for
  v0, the syncer after) and every reader given the key requires a valid signature. Reads are capped at the
  size the layout allows (fp32 fragment + header slack), so a hostile object costs one refused request.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco import keys
from ddiloco.fragments import Fragment, partition
from ddiloco.model import GPT, GPTConfig, gpt_config, init_model
from ddiloco.protocol import wire
from ddiloco.store.base import ObjectTooLarge, Store

log = logging.getLogger(__name__)

MAX_FRAGMENT_BYTES = 16 << 30
"""Upper bound for callers without a layout; readers with one use `fragment_max_bytes`."""
HEADER_SLACK = 1 << 20
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(slots=True)
class Layout:
    fragments: list[Fragment]
    shapes: dict[str, list[int]]
    embedding_names: frozenset[str]
    model: dict[str, Any]

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

    def to_json(self) -> dict[str, Any]:
        return {
            "fragments": [
                {"fragment_id": f.fragment_id, "names": list(f.names), "numel": f.numel}
                for f in self.fragments
            ],
            "shapes": self.shapes,
            "embedding_names": sorted(self.embedding_names),
            "model": self.model,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Layout:
        return cls(
            fragments=[Fragment(f["fragment_id"], tuple(f["names"]), f["numel"]) for f in d["fragments"]],
            shapes={k: list(v) for k, v in d["shapes"].items()},
            embedding_names=frozenset(d["embedding_names"]),
            model=d["model"],
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
    numels = {n: p.numel() for n, p in model.named_parameters()}
    return Layout(
        fragments=partition(numels, num_fragments),
        shapes={n: list(p.shape) for n, p in model.named_parameters()},
        embedding_names=frozenset(model.embedding_names()),
        model=dataclasses.asdict(model.config)
        if dataclasses.is_dataclass(model.config)
        else dict(model.config),
    )


def read_layout(store: Store) -> Layout:
    return Layout.from_json(store.get_json(keys.LAYOUT))


def build_model(layout: Layout, seed: int = 0) -> GPT:
    return init_model(layout.gpt_config(), seed)


def publish_global(
    store: Store,
    run_id: str,
    p: int,
    version: int,
    tensors: dict[str, torch.Tensor],
    dtype: str,
    extra: dict | None = None,
    *,
    key: bytes | None = None,
) -> int:
    """Write global version `version` of fragment p (signed with the run `key`, if any), then its latest
    pointer. Returns bytes written. (The syncer creates versions write-once instead: `ddiloco.syncer.state`.)"""
    blob = pack_global(run_id, p, version, tensors, dtype, extra, key=key)
    store.put(keys.global_key(p, version), blob)
    put_latest(store, p, version)
    return len(blob)


def pack_global(
    run_id: str,
    p: int,
    version: int,
    tensors: dict[str, torch.Tensor],
    dtype: str,
    extra: dict | None = None,
    *,
    key: bytes | None = None,
) -> bytes:
    """The payload of global version `version` of fragment p in `dtype`, its header extended by `extra`."""
    tdtype = _DTYPES[dtype]
    return wire.pack(
        {n: t.detach().to(tdtype) for n, t in tensors.items()},
        {"run_id": run_id, "kind": "global", "fragment_id": p, "version": version, **(extra or {})},
        key=key,
    )


def put_latest(store: Store, p: int, version: int) -> None:
    """Point fragment p's `latest` pointer at `version` (written after the version itself)."""
    store.put_json(keys.global_latest_key(p), {"version": version, "key": keys.global_key(p, version)})


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


def read_global(
    store: Store, run_id: str, layout: Layout, p: int, version: int, *, key: bytes | None = None
) -> dict[str, torch.Tensor]:
    """Read and verify global version `version` of fragment p; tensors come back as fp32.

    Raises `wire.PayloadError` for anything unacceptable (an oversized object is `too_large`)."""
    blob = get_capped(store, keys.global_key(p, version), layout.fragment_max_bytes(p))
    payload = wire.unpack(
        blob, expect={"run_id": run_id, "kind": "global", "fragment_id": p, "version": version}, key=key
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
        if not bool(torch.isfinite(out[name]).all()):
            raise wire.PayloadError("non_finite", f"global tensor {name} has NaN/Inf")
    return out


def get_capped(store: Store, key: str, max_bytes: int) -> bytes:
    """The object at `key`, refused as `PayloadError("too_large")` above `max_bytes` (one request either way)."""
    try:
        return store.get(key, max_bytes=max_bytes)
    except ObjectTooLarge as e:
        raise wire.PayloadError("too_large", str(e)) from None


def write_initial_globals(
    store: Store, run_id: str, model: GPT, layout: Layout, dtype: str, *, key: bytes | None = None
) -> None:
    """Global version 0 of every fragment, from the seeded init. Written once, before any learner starts."""
    store.put_json(keys.LAYOUT, layout.to_json())
    params = dict(model.named_parameters())
    for frag in layout.fragments:
        if latest_version(store, frag.fragment_id) is not None:
            continue
        publish_global(store, run_id, frag.fragment_id, 0, {n: params[n] for n in frag.names}, dtype, key=key)
