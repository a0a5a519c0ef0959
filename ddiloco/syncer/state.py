"""The syncer's own objects in the run store, and its restart from them.

`SyncerFiles` is the only code that reads or writes what the syncer owns: syncer/state.json, the status,
round records, outer momentum, fp32 masters, global versions and the final model. Per merge `publish` writes
momentum → master → round record → download delta → global version + latest pointer, and the caller then
writes the status and the state. All but the pointer are write-once and name the writer's lease epoch, so a
version is published by exactly one syncer; what a publish finds at its keys is judged by
`ddiloco.syncer.adopt`. A starting syncer adopts every contiguous version a crash left unrecorded (`resume`),
so it never publishes a version twice and never loses a merged one. A restart takes Θ_p from the signed fp32
master; a master or momentum that does not verify falls back (published values, zero momentum) rather than
stopping the run. The final model is the fp32 master of every fragment.

Design notes: docs/internals.md, "The syncer's objects and its restart".
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import torch

from ddiloco import keys
from ddiloco.codec.base import all_finite
from ddiloco.codec.registry import publishes_deltas
from ddiloco.platform import failpoints
from ddiloco.protocol import signing, wire
from ddiloco.protocol.messages import (
    Ledger,
    Merged,
    OpenRound,
    RoundRecord,
    Status,
    SyncerState,
)
from ddiloco.run.downlink import digest, encode_step
from ddiloco.run.globalmodel import (
    Layout,
    latest_version,
    pack_global_blob,
    pack_global_delta,
    put_latest,
    read_global_full,
)
from ddiloco.run.root import RunRoot
from ddiloco.store.base import NotFound, ObjectTooLarge
from ddiloco.store.blob import Blob, Data, Lend
from ddiloco.syncer import adopt
from ddiloco.syncer.fragment import GlobalFragment, MergeRule, Proposal, Tensors
from ddiloco.syncer.lease import Fenced
from ddiloco.syncer.merge.bufferpool import SYNCER_POOL, Loan
from ddiloco.syncer.merge.outer import OuterNesterov

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Books:
    """The syncer's run-long counters of rounds (persisted in the state)."""

    started_wall: float
    incarnation: int = 0
    next_round: int = 0
    rounds_merged: int = 0
    rounds_abandoned: int = 0
    merged_recent: deque[Merged] = field(default_factory=deque)
    """The newest merges, as the status lists them (bounded: `recent_len`)."""
    clipped: Counter[str] = field(default_factory=Counter)
    xi_quorum: float = 0.0
    """EMA of the time from opening a round to its quorum."""
    xi_sync: float = 0.0
    """EMA of the time a merge takes (arithmetic and publishing)."""
    xi_link: float = 0.0
    """EMA of the rounds' transport time (`rounds.link_time`): the grace window's allowance for links."""
    bytes_published: int = 0

    @staticmethod
    def recent_len(num_fragments: int) -> int:
        return 8 * num_fragments + 16

    def account(self, record: RoundRecord) -> None:
        self.rounds_merged += 1
        self.merged_recent.append(Merged.of(record))

    def state_dict(self) -> dict[str, Any]:
        """Every counter, under its name in the state (`ddiloco.stateful.Stateful`)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return out | {"merged_recent": list(self.merged_recent), "clipped": dict(self.clipped)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The saved counters; `merged_recent` keeps this syncer's bound (`recent_len`)."""
        bound = self.merged_recent.maxlen
        for f in fields(self):
            setattr(self, f.name, state[f.name])
        self.merged_recent = deque(state["merged_recent"], maxlen=bound)
        self.clipped = Counter(state["clipped"])


@dataclass(slots=True)
class Resumed:
    """What a starting syncer continues from: the saved state (empty books on a first start) with any
    version published after it adopted into `books`, `fragments` and `open_rounds`; `state`: the saved
    state's fields, which the syncer's other parts load (`ddiloco.stateful`; None on a first start)."""

    books: Books
    fragments: list[GlobalFragment]
    open_rounds: list[OpenRound] = field(default_factory=list)
    state: dict[str, Any] | None = None


class SyncerFiles:
    """The syncer's reads and writes of the run store (see the module docstring)."""

    def __init__(
        self, root: RunRoot, layout: Layout, dtype: str = "fp32", download_codec: str = "none"
    ) -> None:
        """`root`: the run root; `dtype`: the run's `diloco.global_dtype`, what global versions are published
        as; `download_codec`: `diloco.download_codec` (`ddiloco.run.downlink`)."""
        self.store, self.run_id, self.layout, self.dtype = root.store, root.run_id, layout, dtype
        self.root, self.signer = root, root.signer
        self.download_codec = download_codec
        self.slots = adopt.VersionSlots(root, layout)
        """What is at the global version keys: adoption, judging a taken key, the quarantine."""
        self._judged: tuple[int, int, int] | None = None
        """(fragment, version, round) whose global version key this publish attempt already judged (`_create`)."""
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddiloco-publish")
        """Writes a publish's first objects while the publishing thread computes the download delta."""
        self._digests: dict[int, tuple[int, str]] = {}
        """Fragment -> (version, SHA-256 of its published values) as last read and verified: a publish reads
        its base back and names the base's digest in the delta; hashing a 193 MB fragment again costs ~0.1 s."""

    @property
    def keeps_master(self) -> bool:
        """Whether published versions differ from the fp32 master (bf16 globals or download deltas), so the
        master is persisted per version."""
        return self.dtype != "fp32" or publishes_deltas(self.download_codec)

    # --- documents ----------------------------------------------------------------------------------------
    def load_state(self) -> SyncerState | None:
        """The saved state; None when there is none, or it is not signed by the syncer's key (a forgery:
        logged, and the syncer adopts what the store's verified global versions say)."""
        obj = self.root.signed_document(keys.SYNCER_STATE)
        if obj is None:
            return None
        run_id = obj.get("run_id") if isinstance(obj, dict) else None
        if run_id != self.run_id:
            raise ValueError(f"{keys.SYNCER_STATE} belongs to run {run_id!r}, not {self.run_id!r}")
        return SyncerState.from_json(obj)

    def save_state(self, state: SyncerState) -> None:
        self.root.write_signed_document(keys.SYNCER_STATE, state.to_json())

    def put_status(self, status: Status) -> None:
        self.root.write_signed_document(keys.STATUS, status.to_json())

    def round_records(self) -> list[RoundRecord]:
        return [RoundRecord.from_json(self.store.get_json(k), k) for k in self.store.list(keys.ROUNDS)]

    # --- tensors ------------------------------------------------------------------------------------------
    def read_global(self, p: int, version: int, lend: Lend | None = None) -> Tensors:
        """Version `version` of fragment p as published, verified; `lend`: read into the caller's memory."""
        got = read_global_full(self.store, self.signer, self.layout, p, version, lend=lend)
        self._digests[p] = (version, got.digest)  # verified against the data as read
        return got.tensors

    def digest_of(self, p: int, version: int, values: Tensors) -> str:
        """The digest of fragment p's published `version`, whose `values` the caller holds."""
        known = self._digests.get(p)
        return known[1] if known is not None and known[0] == version else digest(values, self.dtype)

    def read_momentum(self, p: int, version: int, rule: MergeRule) -> OuterNesterov:
        """Outer momentum of fragment p at `version` (> 0); one that fails verification restarts from zero."""
        outer = rule.optimizer()
        try:
            payload = self.signer.unpack(
                self.store.get(keys.momentum_key(p, version), max_bytes=self.layout.fragment_max_bytes(p)),
                {"kind": "momentum", "fragment_id": p, "version": version},
            )
            if any(list(t.shape) != self.layout.shapes.get(n) for n, t in payload.tensors.items()):
                raise wire.PayloadError("wrong_shape", "momentum does not match the fragment layout")
            outer.load_state_dict(payload.tensors)
            scale = payload.meta.get("lr_scale")  # absent before schedule-aware momentum: taken as the next
            if isinstance(scale, int | float) and not isinstance(scale, bool) and math.isfinite(scale):
                outer.lr_scale = float(scale) if scale >= 0 else None
        except (wire.PayloadError, NotFound, ObjectTooLarge, ValueError) as e:
            log.error(
                "syncer: outer momentum of fragment %d v%d unusable (%s); restarting it from zero",
                p,
                version,
                e,
            )
            return rule.optimizer()
        return outer

    def read_master(self, p: int, version: int) -> Tensors | None:
        """The fp32 master of fragment p at `version`; None (logged) when it is missing or fails verification."""
        try:
            payload = self.signer.unpack(
                self.store.get(keys.master_key(p, version), max_bytes=self.layout.fragment_max_bytes(p)),
                {"kind": "master", "fragment_id": p, "version": version},
            )
            names = set(self.layout.fragments[p].names)
            if set(payload.tensors) != names or any(
                list(t.shape) != self.layout.shapes[n] for n, t in payload.tensors.items()
            ):
                raise wire.PayloadError("wrong_shape", "master does not match the fragment layout")
            if any(t.dtype != torch.float32 for t in payload.tensors.values()):
                raise wire.PayloadError("wrong_dtype", "master is not fp32")
            if not all(all_finite(t) for t in payload.tensors.values()):
                raise wire.PayloadError("non_finite", "master holds NaN/Inf values")
        except (wire.PayloadError, NotFound, ObjectTooLarge) as e:
            log.error(
                "syncer: fp32 master of fragment %d v%d unusable (%s); continuing from the published "
                "(rounded) values",
                p,
                version,
                e,
            )
            return None
        return {n: t.contiguous() for n, t in payload.tensors.items()}

    def load_fragment(self, p: int, version: int, ledger: Ledger, rule: MergeRule) -> GlobalFragment:
        outer = self.read_momentum(p, version, rule) if version > 0 else rule.optimizer()
        master = self.read_master(p, version) if self.keeps_master and version > 0 else None
        return GlobalFragment(
            p,
            version,
            master if master is not None else self.read_global(p, version),
            outer,
            ledger,
            read=lambda v: self.read_global(p, v),
        )

    def publish(self, proposal: Proposal, record: RoundRecord) -> int:
        """Persist one merge of fragment `record.fragment_id` (momentum → master → record → download delta →
        global + pointer), each write-once object created conditionally and naming `record.epoch`; returns the
        bytes of the global payloads. `Fenced` when another syncer published this version first.

        From reused memory: payloads are written from the tensors' own memory (`wire.pack_blob`), L_{v−1} is
        read back into a pooled buffer and L_v computed in it, and the first three objects are packed and written
        on the writer thread, in order, while this thread reads L_{v−1} and encodes the delta; the delta and the
        global version follow once they landed, so the persist order is unchanged."""
        p, version, epoch = record.fragment_id, proposal.version, record.epoch
        self._judged = None  # a retried publish judges the global version key again
        meta = {
            "run_id": self.run_id,
            "kind": "momentum",
            "fragment_id": p,
            "version": version,
            "epoch": epoch,
        }
        scale = {} if proposal.outer.lr_scale is None else {"lr_scale": proposal.outer.lr_scale}
        first: list[tuple[str, Callable[[], Data], str]] = [
            (
                keys.momentum_key(p, version),
                partial(self.signer.pack_blob, proposal.outer.state_dict(), {**meta, **scale}),
                "after_momentum",
            )
        ]
        if self.keeps_master:  # the published version is not the master: keep the master itself
            master = partial(self.signer.pack_blob, proposal.theta, {**meta, "kind": "master"})
            first.append((keys.master_key(p, version), master, "after_master"))
        first.append(
            (
                keys.round_record_key(record.round),
                partial(_json_bytes, signing.sign_doc(record.to_json(), self.root.key, signing.SYNCER)),
                "after_record",
            )
        )
        loan = Loan(SYNCER_POOL)
        writes = self._writer.submit(self._create_all, first, p, version, record)
        try:
            published, values_digest, delta = _values_to_publish(self, proposal, p, version, loan)
        finally:  # waits: the first objects are written, or failed, before going on
            first_error = writes.exception()
        if first_error is not None:
            loan.give_back()
            raise first_error
        try:
            written = 0
            if delta is not None:  # the delta first: whoever sees version v named anywhere finds both objects
                self._create(keys.global_delta_key(p, version), delta, p, version, record, "after_delta")
                written += len(delta)
                del delta
            extra = {"round": record.round, "epoch": epoch}
            blob = pack_global_blob(
                self.signer, p, version, published, self.dtype, extra, digest=values_digest
            )
            gkey = keys.global_key(p, version)
            if not self.store.create(gkey, blob) and not self.slots.ours(record, version):
                if not self.store.create(gkey, blob):  # the slot was free again: another writer raced us
                    raise Fenced(f"global version {version} of fragment {p} was published by another syncer")
            written += len(blob)
        finally:
            loan.give_back()  # L_v lived in it; the blob that borrowed it is written
        failpoints.hit("publish", "after_global")
        put_latest(self.store, p, version)
        failpoints.hit("publish", "after_pointer")
        return written

    def _create_all(
        self, objects: list[tuple[str, Callable[[], Data], str]], p: int, version: int, record: RoundRecord
    ) -> None:
        """Pack (hashing it) and create each object in order, on the writer thread."""
        for key, pack, step in objects:
            self._create(key, pack(), p, version, record, step)

    def _create(self, key: str, data: Data, p: int, version: int, record: RoundRecord, step: str) -> None:
        """Create a write-once object of the merge publishing version `version` of fragment p, then pass the
        failpoint `step`. Found taken, the global version decides (`VersionSlots.ours`): none yet or this
        publish's own → the object is what a publish that died before its global version left (or this
        publish's earlier attempt), and is overwritten."""
        if not self.store.create(key, data):
            judged = (record.fragment_id, version, record.round)
            if self._judged != judged:  # one read of the global version per publish, not one per taken key
                self.slots.ours(record, version)  # raises when another epoch published it
                self._judged = judged
            log.warning(
                "syncer: overwriting %s, left by a publish that never reached its global version", key
            )
            self.store.put(key, data)
        failpoints.hit("publish", step)

    def write_final(self, fragments: list[GlobalFragment], tokens_merged: float) -> None:
        versions = [f.version for f in fragments]
        final = self.layout.assemble({n: t for f in fragments for n, t in f.theta.items()})
        meta = {"run_id": self.run_id, "kind": "final", "versions": versions}
        self.store.put(keys.FINAL_MODEL, self.signer.pack(final, meta))
        self.store.put_json(
            keys.FINAL_META,
            {"versions": versions, "model": self.layout.model, "tokens_merged": tokens_merged},
        )

    # --- restart ------------------------------------------------------------------------------------------
    def resume(self, rule: MergeRule, started_wall: float, epoch: int | None = None) -> Resumed:
        """The saved state, if any, plus every version published after it (a merge whose pointer, status or
        state write did not happen: the version, its round record and its ledger entries are adopted;
        `VersionSlots.adopt_after`), the latest pointers set to what was adopted. `epoch`: the lease epoch
        this syncer holds (None: no lease; every writer's epoch counts as older)."""
        saved = self.load_state()
        num = self.layout.num_fragments
        books = Books(started_wall, merged_recent=deque(maxlen=Books.recent_len(num)))
        versions, ledgers, open_rounds = [0] * num, [Ledger() for _ in range(num)], []
        state = None
        if saved is not None:  # the parts adoption adds to are loaded first; the syncer loads the others
            state = {f.name: getattr(saved, f.name) for f in fields(saved)}
            books.load_state_dict(state)
            books.incarnation += 1
            self.slots.load_state_dict(state)
            versions, ledgers, open_rounds = list(saved.versions), saved.ledger, list(saved.open_rounds)
        for p in range(num):
            try:
                pointer = latest_version(self.store, p)
            except wire.PayloadError as e:  # unsigned and repaired below from what verifies
                log.error("syncer: the latest pointer of fragment %d is unusable (%s)", p, e)
                pointer = -1
            if pointer is None:
                raise NotFound(f"fragment {p} has no global version 0; run `ddiloco prepare` first")
            versions[p], adopted = self.slots.adopt_after(p, versions[p], epoch)
            for rec in adopted:
                books.account(rec)
                credit(ledgers[p], rec)
                books.next_round = max(books.next_round, rec.round + 1)
                open_rounds = [r for r in open_rounds if r.round != rec.round]
            if pointer != versions[p]:
                log.warning("syncer: pointing fragment %d's latest at v%d (was %s)", p, versions[p], pointer)
                put_latest(self.store, p, versions[p])
        fragments = [self.load_fragment(p, v, ledgers[p], rule) for p, v in enumerate(versions)]
        if state is None:
            return Resumed(books, fragments)
        log.info(
            "syncer incarnation %d resumed run %s at round %d, versions %s",
            books.incarnation,
            self.run_id,
            books.next_round,
            versions,
        )
        return Resumed(books, fragments, open_rounds, state)


def _values_to_publish(
    files: SyncerFiles, proposal: Proposal, p: int, version: int, loan: Loan
) -> tuple[Tensors, str | None, Blob | None]:
    """(L_v, its digest when already known, the signed download delta or None) of a publish. With a
    download codec, L_{v−1} is read back into `loan`'s memory and L_v is computed there."""
    if not publishes_deltas(
        files.download_codec
    ):  # Θ_p rounded to the dtype: packing converts it (no copy for fp32)
        return proposal.theta, None, None
    try:
        held = files.read_global(p, version - 1, lend=loan)  # L_{v−1}, in pooled memory we may overwrite
    except (wire.PayloadError, NotFound) as e:  # overwritten or corrupted since it was published
        why = e if isinstance(e, wire.PayloadError) else wire.PayloadError("missing", str(e))
        files.slots.move_aside(p, version - 1, why, None, then=f"publishing version {version} in full")
        return proposal.theta, None, None  # no delta: learners read v whole, and the next delta reads v back
    base_digest = files.digest_of(p, version - 1, held)
    scratch = SYNCER_POOL.take(sum(t.numel() for t in proposal.theta.values()))
    try:
        step = encode_step(held, proposal.theta, files.download_codec, files.dtype, scratch=scratch)
    finally:
        SYNCER_POOL.give(scratch)
    values_digest = digest(step.values, files.dtype)
    delta = pack_global_delta(
        files.signer,
        p,
        version,
        step,
        codec=files.download_codec,
        dtype=files.dtype,
        base_digest=base_digest,
        digest=values_digest,
    )
    return step.values, values_digest, delta


def _json_bytes(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode("utf-8")


def credit(ledger: Ledger, record: RoundRecord) -> None:
    """Add a merged round's answers to its fragment's ledger."""
    for c in record.contributors.values():
        ledger.merged_tokens += c.c_tokens
        ledger.merged_steps += c.c_steps
        ledger.merged_answers += 1
