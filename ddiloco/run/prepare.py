"""`ddiloco prepare`: write config, tokenizer, disjoint shards, validation split and global version 0.

One shard per learner id the run may have (`RunConfig.num_shards`), so learners added mid-run read data of
their own (`ddiloco.data.shards`); a pre-tokenized corpus is read in place instead (`ddiloco.data.streamed`).
Idempotent, so an Argo retry of the step or a re-run of the whole pipeline DAG is harmless: a run root that
already holds a config must hold the same config (else an error names the settings that differ), and a
prepared root is only verified. The config is written last, so a prepare that failed on its input can be
rerun with a corrected config. With the run secret (`DDILOCO_RUN_KEY`) shards, validation split and global
version 0 are signed, and a rerun with another secret is refused. Every object goes through
`ddiloco.run.root.RunRoot`.

Design notes: docs/internals.md, "Preparing a run".
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.data.loader import load_texts, split_tokens, tokenize_corpus
from ddiloco.data.streamed import corpus_store, prepare_corpus
from ddiloco.data.synthetic import entropy_floor, make_world, synthetic_documents
from ddiloco.data.tokenizer import Tokenizer, build_tokenizer, tokenizer_from_json
from ddiloco.errors import ConfigError
from ddiloco.model.gpt import GPT, init_model
from ddiloco.protocol import signing, wire
from ddiloco.run.globalmodel import make_layout, model_config_from_run
from ddiloco.run.root import RunRoot
from ddiloco.store.base import Store

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
    root = RunRoot.keyed(store, cfg.run_id, secret, role="prepare")
    existing = root.config_dict()
    if existing is not None:
        differ = config_differences(existing, cfg.to_dict())
        if differ:
            shown = ", ".join(differ[:8]) + (f" and {len(differ) - 8} more" if len(differ) > 8 else "")
            raise ConfigError(
                f"{store.url} already holds a different run config (run_id {existing.get('run_id')!r}; "
                f"differs in {shown}); use a new --run-id / store prefix, or rerun with the same config"
            )
        meta = root.data_meta()
        if meta is not None and root.has_layout():
            _check_existing_signature(root)
            log.info("run %s already prepared at %s", cfg.run_id, store.url)
            return meta

    t0 = time.monotonic()
    source = None if cfg.data.sources else corpus_store(cfg.data.source)
    data = _streamed(cfg, source) if cfg.data.sources or source is not None else _token_data(cfg)
    tok = data.tokenizer
    need = cfg.train.batch_size * (cfg.model.seq_len + 1)
    for i, n in enumerate(data.shard_tokens):
        if n < need:
            raise ConfigError(
                f"shard {i} has {n} tokens, fewer than one batch ({need}): the corpus is cut into "
                f"{len(data.shard_tokens)} shards, {_shards_rule(cfg)}; use a larger corpus, fewer shards (a "
                "smaller diloco.max_learners or data.num_shards), or a smaller train.batch_size / model.seq_len"
            )
    if data.val.numel() < cfg.model.seq_len + 1:
        raise ConfigError("the validation split is shorter than one sequence; raise data.val_fraction")
    model = model_for_run(cfg, tok.vocab_size)  # refusals (model.hf) before anything is written
    if existing is None:  # only once the corpus is known to be usable: a fixed rerun must not be refused
        root.write_config(cfg)

    root.write_tokenizer(tok)
    for i, shard in enumerate(data.shards):
        root.write_shard(i, shard)
    if data.corpus is not None:
        store.put_json(keys.CORPUS, data.corpus)
    root.write_val(data.val)

    layout = make_layout(model, cfg.diloco.fragments)
    root.write_initial_globals(model, layout, cfg.diloco.global_dtype)

    meta = {
        "run_id": cfg.run_id,
        "vocab_size": tok.vocab_size,
        "num_shards": len(data.shard_tokens),
        "shard_tokens": data.shard_tokens,
        "val_tokens": int(data.val.numel()),
        "model_params": model.num_params(),
        "source": cfg.data.source,
        "streamed": data.corpus is not None,
        "prepared_at": time.time(),
        **data.extra,
    }
    if cfg.data.source == "synthetic":
        world = make_world(cfg.seed, n_entities=cfg.data.synthetic_entities)
        meta["entropy_floor"] = entropy_floor(world, cfg.seed, min(cfg.data.synthetic_docs, 2000), tok)
    root.write_data_meta(meta)  # written last: its presence means "prepared"
    log.info(
        "prepared run %s: %d shards × ~%d tokens, %d validation tokens, %d-parameter model in %d fragments (%.1fs)",
        cfg.run_id,
        len(data.shard_tokens),
        sum(meta["shard_tokens"]) // len(data.shard_tokens),
        meta["val_tokens"],
        meta["model_params"],
        layout.num_fragments,
        time.monotonic() - t0,
    )
    return meta


@dataclass(frozen=True)
class RunData:
    """What prepare writes of the data: shards (empty for a streamed corpus), validation, their sizes."""

    tokenizer: Tokenizer
    shards: list[torch.Tensor]
    shard_tokens: list[int]
    val: torch.Tensor
    extra: dict[str, Any]
    corpus: dict[str, Any] | None = None


def _token_data(cfg: RunConfig) -> RunData:
    """Text (or the synthetic corpus) tokenized here and cut into one shard per learner id."""
    texts, extra = corpus_texts(cfg)
    tok = run_tokenizer(cfg, texts)
    tok = tokenizer_from_json(tok.to_json())  # what learners will load: prove it round-trips
    tokens = tokenize_corpus(texts, tok)
    # min_shard_tokens=0: a shard too small for one batch is prepare's ConfigError, which names the keys.
    shards, val = split_tokens(
        tokens, num_shards=cfg.num_shards, val_fraction=cfg.data.val_fraction, min_shard_tokens=0
    )
    return RunData(tok, shards, [int(s.numel()) for s in shards], val, extra)


def _streamed(cfg: RunConfig, source: Store | None) -> RunData:
    """A pre-tokenized corpus (or a mixture of them), read in place (`ddiloco.data.streamed`): no shards in the
    run root."""
    tok = tokenizer_from_json(run_tokenizer(cfg, []).to_json())
    got = prepare_corpus(cfg, tok, source)
    return RunData(tok, [], got.slot_tokens, got.val, {}, got.doc)


def run_tokenizer(cfg: RunConfig, texts: list[str]) -> Tokenizer:
    """The tokenizer `data.tokenizer` names (`auto`: the `model.hf` directory's own if it has one, else bytes;
    a path: that tokenizer.json or directory of tokenizer files)."""
    kind = cfg.data.tokenizer
    if kind in ("auto", "model") and cfg.model.hf:
        from ddiloco.data.hf_tokenizer import TOKENIZER_FILES, has_tokenizer, load_model_tokenizer
        from ddiloco.model.hf.source import model_dir

        path = model_dir(cfg.model.hf)
        if has_tokenizer(path):
            return load_model_tokenizer(path)
        if kind == "model":
            raise ConfigError(
                f"data.tokenizer=model: {path} has none of {', '.join(TOKENIZER_FILES)}; add the model's "
                "tokenizer files there, or set data.tokenizer=byte or bpe"
            )
    if kind not in ("auto", "model", "byte", "bpe"):  # a tokenizer.json or a directory of tokenizer files
        from ddiloco.data.textcorpus.choose import tokenizer_from_spec

        try:
            return tokenizer_from_spec(kind)
        except ValueError as e:
            raise ConfigError(f"data.tokenizer={kind}: {e}") from None
    return build_tokenizer("byte" if kind in ("auto", "model") else kind, texts, cfg.data.vocab_size)


def model_for_run(cfg: RunConfig, vocab_size: int) -> GPT:
    """The model version 0 holds: the built-in GPT (seeded), or the Hugging Face model `model.hf` names."""
    if cfg.model.hf:
        from ddiloco.model.hf.prepare import hf_model_for_run

        return hf_model_for_run(cfg, vocab_size)  # type: ignore[return-value]
    return init_model(model_config_from_run(cfg, vocab_size), cfg.seed)


def config_differences(saved: Any, given: Any, prefix: str = "") -> list[str]:
    """Dotted keys where two config dicts differ (a value, or a key only one of them has)."""
    if isinstance(saved, dict) and isinstance(given, dict):
        out: list[str] = []
        for k in sorted(set(saved) | set(given), key=str):
            out += config_differences(saved.get(k), given.get(k), f"{prefix}{k}.")
        return out
    return [] if saved == given else [prefix.rstrip(".") or "(the whole config)"]


def _shards_rule(cfg: RunConfig) -> str:
    """Why the run has `cfg.num_shards` shards, in the words of its config."""
    if cfg.data.num_shards is not None:
        return f"data.num_shards={cfg.data.num_shards}"
    return f"one per learner id the run may have (diloco.max_learners: {cfg.max_learners})"


def _check_existing_signature(root: RunRoot) -> None:
    if root.key is None:
        return
    try:
        root.read_global(root.layout(), 0, 0)
    except wire.PayloadError as e:
        raise ConfigError(
            f"{root.url} was prepared with another {signing.ENV_VAR} ({e.reason}); "
            "use the same secret as the first prepare, or a new --run-id / store prefix"
        ) from None
