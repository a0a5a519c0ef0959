"""`ddiloco prepare`: write config, tokenizer, disjoint shards, validation split and global version 0.

Idempotent, so an Argo retry of the prepare step is harmless: if the run root already holds a config, it
must be the same config (else a clear error), and nothing that exists is rewritten. The config is written
only after the corpus has been read and split, so a prepare that failed on its input can be rerun with a
corrected config.

With the run secret (`DDILOCO_RUN_KEY`, see `ddiloco.protocol.signing`) shards, validation split and global version
0 are signed with the run's key; a rerun with a different secret is refused with a clear error instead of
leaving learners that reject version 0 forever.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ddiloco import keys
from ddiloco.config import ConfigError, RunConfig
from ddiloco.data import load_texts, split_tokens, tokenize_corpus
from ddiloco.globalmodel import (
    make_layout,
    model_config_from_run,
    read_global,
    read_layout,
    write_initial_globals,
)
from ddiloco.model import init_model
from ddiloco.protocol import signing, wire
from ddiloco.store import Store
from ddiloco.synthetic import entropy_floor, make_world, synthetic_documents
from ddiloco.tokenizer import build_tokenizer, tokenizer_from_json

log = logging.getLogger(__name__)


def corpus_texts(cfg: RunConfig) -> tuple[list[str], dict[str, Any]]:
    d = cfg.data
    if d.source == "synthetic":
        world = make_world(cfg.seed, n_entities=d.synthetic_entities)
        return list(synthetic_documents(world, cfg.seed, d.synthetic_docs)), {"world_seed": cfg.seed}
    return load_texts(d.source, jsonl_field=d.jsonl_field), {}


def prepare(store: Store, cfg: RunConfig, *, secret: bytes | None = None) -> dict[str, Any]:
    """Prepare the run root; returns data/meta.json. `secret`: the master key from DDILOCO_RUN_KEY (None:
    unsigned)."""
    cfg.validate()
    key = signing.for_run(secret, cfg.run_id)
    if key is None:
        signing.warn_unsigned("prepare")
    existing = store.get_json_or_none(keys.CONFIG)
    if existing is not None:
        if existing != cfg.to_dict():
            raise ConfigError(
                f"{store.url} already holds a different run config (run_id {existing.get('run_id')!r}); "
                "use a new --run-id / store prefix, or rerun with the same config"
            )
        meta = store.get_json_or_none(keys.DATA_META)
        if meta is not None and store.exists(keys.LAYOUT):
            _check_existing_signature(store, cfg.run_id, key)
            log.info("run %s already prepared at %s", cfg.run_id, store.url)
            return meta

    t0 = time.monotonic()
    texts, extra = corpus_texts(cfg)
    tok = build_tokenizer(cfg.data.tokenizer, texts, cfg.data.vocab_size)
    tok = tokenizer_from_json(tok.to_json())  # what learners will load: prove it round-trips
    tokens = tokenize_corpus(texts, tok)
    shards, val = split_tokens(tokens, num_shards=cfg.num_shards, val_fraction=cfg.data.val_fraction)
    need = cfg.train.batch_size * (cfg.model.seq_len + 1)
    for i, s in enumerate(shards):
        if s.numel() < need:
            raise ConfigError(
                f"shard {i} has {s.numel()} tokens, fewer than one batch ({need}); use a larger corpus, "
                "fewer data.num_shards, or a smaller train.batch_size / model.seq_len"
            )
    if val.numel() < cfg.model.seq_len + 1:
        raise ConfigError("the validation split is shorter than one sequence; raise data.val_fraction")
    if existing is None:  # only once the corpus is known to be usable: a fixed rerun must not be refused
        store.put_json(keys.CONFIG, cfg.to_dict())

    store.put(keys.TOKENIZER, tok.to_json().encode())
    for i, s in enumerate(shards):
        store.put(
            keys.shard_key(i),
            wire.pack(
                {"tokens": s.to(torch.int32)}, {"run_id": cfg.run_id, "kind": "shard", "shard": i}, key=key
            ),
        )
    store.put(
        keys.VAL, wire.pack({"tokens": val.to(torch.int32)}, {"run_id": cfg.run_id, "kind": "val"}, key=key)
    )

    model = init_model(model_config_from_run(cfg, tok.vocab_size), cfg.seed)
    layout = make_layout(model, cfg.diloco.fragments)
    write_initial_globals(store, cfg.run_id, model, layout, cfg.diloco.global_dtype, key=key)

    meta = {
        "run_id": cfg.run_id,
        "vocab_size": tok.vocab_size,
        "num_shards": len(shards),
        "shard_tokens": [int(s.numel()) for s in shards],
        "val_tokens": int(val.numel()),
        "model_params": model.num_params(),
        "source": cfg.data.source,
        "prepared_at": time.time(),
        **extra,
    }
    if cfg.data.source == "synthetic":
        world = make_world(cfg.seed, n_entities=cfg.data.synthetic_entities)
        meta["entropy_floor"] = entropy_floor(world, cfg.seed, min(cfg.data.synthetic_docs, 2000), tok)
    store.put_json(keys.DATA_META, meta)  # written last: its presence means "prepared"
    log.info(
        "prepared run %s: %d shards × ~%d tokens, %d validation tokens, %d-parameter model in %d fragments (%.1fs)",
        cfg.run_id, len(shards), sum(meta["shard_tokens"]) // len(shards), meta["val_tokens"],
        meta["model_params"], layout.num_fragments, time.monotonic() - t0,
    )  # fmt: skip
    return meta


def load_run_config(store: Store) -> RunConfig:
    d = store.get_json_or_none(keys.CONFIG)
    if d is None:
        raise ConfigError(
            f"no run config at {store.url}/{keys.CONFIG}; run `ddiloco prepare --store {store.url}` first"
        )
    return RunConfig.from_dict(d)


def _check_existing_signature(store: Store, run_id: str, key: bytes | None) -> None:
    if key is None:
        return
    try:
        read_global(store, run_id, read_layout(store), 0, 0, key=key)
    except wire.PayloadError as e:
        raise ConfigError(
            f"{store.url} was prepared with another {signing.ENV_VAR} ({e.reason}); "
            "use the same secret as the first prepare, or a new --run-id / store prefix"
        ) from None


def load_tokens(
    store: Store, key: str, run_id: str, *, max_tokens: int = 2 << 30, run_key: bytes | None = None
) -> torch.Tensor:
    """A token payload (shard or validation split) as int64. Read at most `max_tokens` int32 tokens' worth of
    bytes; with the `run_key` the payload's signature is required."""
    blob = store.get(key, max_bytes=4 * max_tokens + (1 << 20))
    try:
        payload = wire.unpack(blob, expect={"run_id": run_id}, key=run_key)
    except wire.PayloadError as e:
        if e.reason not in ("unsigned", "bad_signature"):
            raise
        raise ConfigError(
            f"{store.url}/{key} does not verify ({e}); give every role the {signing.ENV_VAR} that "
            "prepare used"
        ) from None
    tokens = payload.tensors.get("tokens")
    if tokens is None or tokens.dim() != 1 or tokens.dtype != torch.int32:
        raise wire.PayloadError("malformed", f"{key} holds no 1-D int32 'tokens' tensor")
    return tokens.to(torch.int64)
