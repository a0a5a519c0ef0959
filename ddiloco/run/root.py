"""The run root: every object a run keeps in its store, read and written through one class.

- `RunRoot(store, run_id, key)` is one run as its store holds it: config, data, layout, global versions, the
  final and fine-tuned models and the JSON documents (done, status and summary typed). Key names come from
  `ddiloco.keys`; the global-version primitives from `ddiloco.run.globalmodel`.
- Every role opens one root (`RunRoot.open`, or `keyed` with the config in hand), the only place the run key
  is derived from the master key; learner and syncer hand the root (or its `signer`) to their parts.
- Verification is the default: every payload read through a root or its `signer` is checked against the
  run's key and every payload written is signed with it, with no per-call way to skip that; `key=None` is an
  unsigned run (`RunRoot.open` warns once per role). Post-training refuses a payload that does not verify
  with a one-line `ConfigError` naming `DDILOCO_RUN_KEY`; other problems stay `wire.PayloadError`.
- JSON documents are unsigned but for what the syncer signs (status, done); reads are size-capped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ddiloco import keys
from ddiloco.config.run import RunConfig
from ddiloco.data.tokenizer import Tokenizer, tokenizer_from_json
from ddiloco.errors import ConfigError
from ddiloco.model.gpt import GPT
from ddiloco.protocol import signing, wire
from ddiloco.protocol.messages import Done, Status
from ddiloco.protocol.summary import Summary
from ddiloco.run import globalmodel
from ddiloco.run.globalmodel import Layout, build_model
from ddiloco.store.base import NotFound, Store

log = logging.getLogger(__name__)

MAX_TOKENIZER_BYTES = 256 << 20
"""A BPE vocabulary of a few 100k merges is tens of MB."""
MAX_TOKENS = 2 << 30
"""Default cap of a token payload read (int32 tokens)."""
MAX_DOC_BYTES = 16 << 20
MAX_PAYLOAD_MODEL_BYTES = globalmodel.MAX_FRAGMENT_BYTES * 4
"""Cap of a model read from an arbitrary payload key (a learner checkpoint also holds optimizer state)."""
SIGNATURE_REASONS = ("unsigned", "bad_signature")
SIGNING_ROLES = frozenset({"syncer", "prepare", "launcher", "sft", "export"})
"""Roles that write what only the syncer's key may sign (global versions, shards, models, status)."""

T = TypeVar("T")


def signature_advice(where: str, error: wire.PayloadError) -> str:
    """One line: which object failed its signature check and what to set."""
    return (
        f"{where} does not verify ({error}); set {signing.ENV_VAR} to the key this run was prepared with "
        "(`ddiloco run` keeps it in WORKDIR/RUN_ID.key; unset it only for an unsigned run)"
    )


@dataclass(frozen=True, slots=True)
class RunRoot:
    store: Store
    run_id: str
    key: signing.RunKeys | None = None
    """The run's keys (`signing.for_run`); None: unsigned, nothing is signed or verified."""

    # --- opening -----------------------------------------------------------------------------------------
    @classmethod
    def open(cls, store: Store, secret: bytes | signing.LearnerShare | None, *, role: str) -> RunRoot:
        """The prepared run at `store`, with the run key derived from the master `secret` (None: unsigned,
        logged once for `role`)."""
        return cls.keyed(store, cls.read_config(store).run_id, secret, role=role)

    @classmethod
    def keyed(
        cls, store: Store, run_id: str, secret: bytes | signing.LearnerShare | None, *, role: str
    ) -> RunRoot:
        """Run `run_id` at `store` (its config read already), with the run's keys derived from `secret`
        (None: unsigned, logged once for `role`). A learner keeps a learner's keys only, whatever it holds."""
        key = signing.for_run(secret, run_id)
        if key is None:
            signing.warn_unsigned(role)
        elif key.seed is None and role in SIGNING_ROLES:
            raise ConfigError(
                f"{role} signs as the syncer and needs {signing.ENV_VAR} (the master key); it was given only "
                f"a learner's share ({signing.LEARNER_KEY_VAR})"
            )
        elif role.startswith("learner"):
            if isinstance(secret, bytes):
                signing.warn_master_in_learner(role)
            key = key.learner_only()
        return cls(store, run_id, key)

    @classmethod
    def from_env(cls, store: Store, *, role: str) -> RunRoot:
        """`open` with the master key from `DDILOCO_RUN_KEY` (what every CLI role does)."""
        return cls.open(store, signing.key_from_env(), role=role)

    @property
    def url(self) -> str:
        return self.store.url

    @property
    def signer(self) -> wire.RunSigner:
        """What packs and unpacks this run's payloads: its run id and key."""
        return wire.RunSigner(self.run_id, self.key)

    # --- config and data ---------------------------------------------------------------------------------
    @staticmethod
    def read_config(store: Store) -> RunConfig:
        """The run config at `store`; a ConfigError saying to run prepare when there is none."""
        d = store.get_json_or_none(keys.CONFIG, max_bytes=MAX_DOC_BYTES)
        if d is None:
            raise ConfigError(
                f"no run config at {store.url}/{keys.CONFIG}; run `ddiloco prepare --store {store.url}` first"
            )
        return RunConfig.from_dict(d)

    def config(self) -> RunConfig:
        return self.read_config(self.store)

    def config_dict(self) -> dict[str, Any] | None:
        """The stored config as written (None before prepare), for comparing with another config."""
        return self.store.get_json_or_none(keys.CONFIG, max_bytes=MAX_DOC_BYTES)

    def write_config(self, cfg: RunConfig) -> None:
        self.store.put_json(keys.CONFIG, cfg.to_dict())

    def data_meta(self) -> dict[str, Any] | None:
        """data/meta.json: written last by prepare, so its presence means "prepared"."""
        return self.store.get_json_or_none(keys.DATA_META, max_bytes=MAX_DOC_BYTES)

    def prepared_at(self) -> float | None:
        """When the run was prepared (see `prepared_at_of`)."""
        return prepared_at_of(self.data_meta())

    def write_data_meta(self, meta: Mapping[str, Any]) -> None:
        self.store.put_json(keys.DATA_META, dict(meta))

    def tokenizer(self) -> Tokenizer:
        return tokenizer_from_json(self.store.get(keys.TOKENIZER, max_bytes=MAX_TOKENIZER_BYTES).decode())

    def write_tokenizer(self, tok: Tokenizer) -> None:
        self.store.put(keys.TOKENIZER, tok.to_json().encode())

    def tokens(self, key: str, *, max_tokens: int = MAX_TOKENS) -> torch.Tensor:
        """A token payload (shard or validation split) as int64, at most `max_tokens` int32 tokens' worth of
        bytes read, its signature required with the run key."""
        blob = self.store.get(key, max_bytes=4 * max_tokens + (1 << 20))
        payload = self._unpack(key, blob, {})
        tokens = payload.tensors.get("tokens")
        if tokens is None or tokens.dim() != 1 or tokens.dtype != torch.int32:
            raise wire.PayloadError("malformed", f"{key} holds no 1-D int32 'tokens' tensor")
        return tokens.to(torch.int64)

    def shard(self, i: int, *, max_tokens: int = MAX_TOKENS) -> torch.Tensor:
        return self.tokens(keys.shard_key(i), max_tokens=max_tokens)

    def val(self) -> torch.Tensor:
        return self.tokens(keys.VAL)

    def training_tokens(self, slot: int, *, max_tokens: int = 1 << 24) -> torch.Tensor:
        """Pre-training tokens of shard `slot`: the shard, or the first `max_tokens` of a streamed corpus's
        slot (`ddiloco.data.streamed`), e.g. for SFT's replay windows."""
        if (self.data_meta() or {}).get("streamed"):
            from ddiloco.data.streamed import first_tokens, read_corpus_doc

            return first_tokens(read_corpus_doc(self.store), slot, max_tokens)
        return self.shard(slot)

    def write_shard(self, i: int, tokens: torch.Tensor) -> None:
        self._write_tokens(keys.shard_key(i), tokens, {"kind": "shard", "shard": i})

    def write_val(self, tokens: torch.Tensor) -> None:
        self._write_tokens(keys.VAL, tokens, {"kind": "val"})

    def _write_tokens(self, key: str, tokens: torch.Tensor, meta: dict[str, Any]) -> None:
        blob = self.signer.pack({"tokens": tokens.to(torch.int32)}, meta)
        self.store.put(key, blob)

    # --- the global model --------------------------------------------------------------------------------
    def layout(self) -> Layout:
        return globalmodel.read_layout(self.store)

    def has_layout(self) -> bool:
        return self.store.exists(keys.LAYOUT)

    def latest_version(self, p: int) -> int | None:
        return globalmodel.latest_version(self.store, p)

    def read_global(self, layout: Layout, p: int, version: int) -> dict[str, torch.Tensor]:
        """Global version `version` of fragment p, verified (`wire.PayloadError` for anything unacceptable)."""
        return globalmodel.read_global(self.store, self.signer, layout, p, version)

    def publish_global(
        self,
        p: int,
        version: int,
        tensors: dict[str, torch.Tensor],
        dtype: str,
        extra: dict[str, Any] | None = None,
    ) -> int:
        return globalmodel.publish_global(self.store, self.signer, p, version, tensors, dtype, extra)

    def write_initial_globals(self, model: GPT, layout: Layout, dtype: str) -> None:
        globalmodel.write_initial_globals(self.store, self.signer, model, layout, dtype)

    def model_at_versions(self, layout: Layout, versions: list[int]) -> GPT:
        """The global model assembled from one version of every fragment."""
        model = build_model(layout)
        params = layout.members(dict(model.named_parameters()))
        with torch.no_grad():
            for frag, v in zip(layout.fragments, versions, strict=True):
                tensors = self._verified(
                    keys.global_key(frag.fragment_id, v),
                    lambda p=frag.fragment_id, v=v: self.read_global(layout, p, v),
                )
                for n, t in tensors.items():
                    params[n].copy_(t)
        return model

    def latest_versions(self, layout: Layout) -> list[int]:
        versions = []
        for frag in layout.fragments:
            v = self.latest_version(frag.fragment_id)
            if v is None:
                raise NotFound(
                    f"fragment {frag.fragment_id} has no global version; run `ddiloco prepare` first"
                )
            versions.append(v)
        return versions

    # --- final and fine-tuned models, any full-model payload -----------------------------------------------
    def final_model(self, layout: Layout) -> GPT:
        """The syncer's final model; refused (ConfigError) when it does not verify under the run key."""
        blob = globalmodel.get_capped(self.store, keys.FINAL_MODEL, layout.model_max_bytes())
        payload = self._unpack(keys.FINAL_MODEL, blob, {"kind": "final"})
        return load_parameters(build_model(layout), payload.tensors, "final model", prefixed=False)

    def write_final_model(
        self, tensors: dict[str, torch.Tensor], versions: list[int], meta: Mapping[str, Any]
    ) -> None:
        """final/model.safetensors (signed) and final/meta.json."""
        header = {"kind": "final", "versions": versions}
        self.store.put(keys.FINAL_MODEL, self.signer.pack(tensors, header))
        self.store.put_json(keys.FINAL_META, dict(meta))

    def has_final_model(self) -> bool:
        return self.store.exists(keys.FINAL_MODEL)

    def payload_model(
        self, key: str, layout: Layout, *, kind: str | None = None
    ) -> tuple[GPT, dict[str, Any]]:
        """(model, header) from a verified payload holding every parameter, named `name` or `param/name`
        (the fine-tuned model, a learner checkpoint, ...); `kind`: the one it must be (None: any the syncer
        signs; a learner checkpoint must be asked for as `learner_ckpt`, its signer being a learner)."""
        blob = self.store.get(key, max_bytes=MAX_PAYLOAD_MODEL_BYTES)
        payload = self._unpack(key, blob, {} if kind is None else {"kind": kind})
        return load_parameters(build_model(layout), payload.tensors, key, prefixed=True), payload.meta

    def write_sft_model(self, model: GPT, header: Mapping[str, Any]) -> None:
        """sft/model.safetensors (kind "sft"), signed with the run key."""
        state = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
        meta = {**header, "kind": "sft"}
        self.store.put(keys.SFT_MODEL, self.signer.pack(state, meta))

    # --- JSON documents ----------------------------------------------------------------------------------
    def document(self, key: str) -> dict[str, Any] | None:
        """A small JSON document of the run root (None when absent)."""
        return self.store.get_json_or_none(key, max_bytes=MAX_DOC_BYTES)

    def write_document(self, key: str, doc: Mapping[str, Any]) -> None:
        self.store.put_json(key, dict(doc))

    def signed_document(self, key: str, role: str = signing.SYNCER) -> dict[str, Any] | None:
        """A JSON document `role` signs (status, done, round records: the syncer), or None when it is
        absent or does not verify (logged: a forgery is never acted on)."""
        doc = self.document(key)
        if doc is None:
            return None
        problem = signing.check_doc(doc, self.key, role)
        if problem is not None:
            log.warning("ignoring %s/%s: %s (only the %s signs it)", self.url, key, problem, role)
            return None
        return doc

    def write_signed_document(self, key: str, doc: Mapping[str, Any]) -> None:
        """A JSON document signed by the syncer's key (what learners act on: status, done)."""
        self.store.put_json(key, signing.sign_doc(doc, self.key, signing.SYNCER))

    def is_done(self) -> bool:
        """Whether the syncer marked the run done (a marker it did not sign does not count, one it did does)."""
        return self.signed_document(keys.DONE) is not None

    def done(self) -> Done | None:
        """The syncer's done marker (None: absent, or not signed by it); ValueError when it does not read."""
        doc = self.signed_document(keys.DONE)
        return None if doc is None else Done.from_json(doc)

    def status(self) -> Status | None:
        """The syncer's status (None: absent, or not signed by it); ValueError when it does not read."""
        doc = self.signed_document(keys.STATUS)
        return None if doc is None else Status.from_json(doc)

    def summary(self) -> Summary | None:
        """summary.json (None before one was written); ValueError when it does not read."""
        doc = self.document(keys.SUMMARY)
        return None if doc is None else Summary.from_json(doc)

    def write_summary(self, summary: Summary) -> None:
        self.store.put_json(keys.SUMMARY, summary.to_json())

    def write_launcher_events(self, events: Mapping[str, Any]) -> None:
        self.store.put_json(keys.LAUNCHER_EVENTS, dict(events))

    def eval_result(self, name: str) -> dict[str, Any] | None:
        return self.document(keys.eval_key(name))

    def write_eval_result(self, name: str, result: Mapping[str, Any]) -> None:
        self.store.put_json(keys.eval_key(name), dict(result))

    def sft_meta(self) -> dict[str, Any] | None:
        return self.document(keys.SFT_META)

    def write_sft_meta(self, meta: Mapping[str, Any]) -> None:
        self.store.put_json(keys.SFT_META, dict(meta))

    def sft_skipped(self) -> str | None:
        """Why fine-tuning was skipped, when it was and no fine-tuned model exists; else None."""
        doc = self.document(keys.SFT_SKIPPED)
        if doc is None or self.store.exists(keys.SFT_MODEL):
            return None
        return str(doc.get("reason", "skipped"))

    def write_sft_skipped(self, reason: str) -> None:
        self.store.put_json(keys.SFT_SKIPPED, {"reason": reason, "at": time.time()})

    def learner_checkpoint_key(self, learner_id: int) -> str:
        """The key of a learner's newest checkpoint (NotFound when it has none)."""
        pointer = self.document(keys.ckpt_latest_key(learner_id))
        if pointer is None:
            raise NotFound(f"learner {learner_id} has no checkpoint in {self.url}")
        return pointer["key"]

    # --- verification ------------------------------------------------------------------------------------
    def _unpack(self, key: str, blob: bytes, expect: Mapping[str, Any]) -> wire.Payload:
        return self._verified(key, lambda: self.signer.unpack(blob, expect))

    def _verified(self, key: str, read: Callable[[], T]) -> T:
        """`read()`, with a signature failure turned into a one-line ConfigError saying which key to set."""
        try:
            return read()
        except wire.PayloadError as e:
            if e.reason not in SIGNATURE_REASONS:
                raise
            raise ConfigError(signature_advice(f"{self.url}/{key}", e)) from None


def load_parameters(model: GPT, tensors: Mapping[str, torch.Tensor], what: str, *, prefixed: bool) -> GPT:
    """Copy every parameter of `model` from `tensors` (named `name`, or also `param/name` when `prefixed`)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            t = tensors.get(n)
            if t is None and prefixed:
                t = tensors.get(f"param/{n}")
            if t is None or t.shape != p.shape:
                raise wire.PayloadError("wrong_shape", f"{what} is missing or mis-shapes parameter {n}")
            p.copy_(t.float())
    return model


def prepared_at_of(meta: Mapping[str, Any] | None) -> float | None:
    """`prepared_at` of a data meta (data/meta.json): the origin of the chaos clock and of
    `diloco.deadline_s`, and the base time of versions a syncer did not publish (`ddiloco.protocol.claims`);
    None when there is no meta, or its `prepared_at` is missing or not a finite number."""
    t = meta.get("prepared_at") if isinstance(meta, Mapping) else None
    return float(t) if isinstance(t, int | float) and not isinstance(t, bool) and math.isfinite(t) else None
