"""Global versions into a learner: waited for at start, downloaded off the loop, verified, mixed into the model.

A learner never trains from a random init: `wait_for_latest` blocks until every fragment has a version, and
`first` takes the newest that verifies. Downloads run on the learner's I/O pool; the loop collects finished
ones at a step boundary, for the fragments the caller says may be overwritten now. A version that fails
verification is logged, counted by reason (`rejected_globals`) and skipped, never retried. The anchors (what
an answer's delta is taken against) live here with the version and digest they hold (`held`). With
compressed downloads (`ddiloco.run.downlink`) a fragment one version behind applies the signed delta, bit for bit
the full version; anything else (a join, a gap, a delta that does not fit) fetches the full version.
`bytes_down` counts the objects' stored sizes.

Design notes (why no chains of deltas): docs/internals.md, "Global versions into a learner".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ddiloco import keys
from ddiloco.codec.registry import publishes_deltas
from ddiloco.config.run import DilocoConfig
from ddiloco.learner.accel import HostCopier, pin
from ddiloco.learner.health import IoErrors, guard
from ddiloco.learner.sharded import LiveMembers, ShardedMembers
from ddiloco.protocol import signing, wire
from ddiloco.run.downlink import apply_delta
from ddiloco.run.globalmodel import (
    GlobalDelta,
    Layout,
    Received,
    latest_version,
    read_global_delta,
    read_global_full,
)
from ddiloco.run.root import RunRoot
from ddiloco.store.base import NotFound, StoreError, StoreUnavailable
from ddiloco.tracking.metrics import LearnerMetrics

__all__ = ["VersionFeed"]

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
Download = tuple[int, "Received | GlobalDelta | wire.PayloadError", "Exception | None"]
"""What a download future returns: (version, what was read, why a delta tried first was not usable)."""


class VersionFeed:
    """Fragments' global versions for one learner; `anchors`: the versions received, on the device."""

    def __init__(
        self,
        root: RunRoot,
        layout: Layout,
        members: LiveMembers | ShardedMembers,
        copier: HostCopier,
        metrics: LearnerMetrics,
        diloco: DilocoConfig | None = None,
        *,
        learner_id: int,
        errors: IoErrors | None = None,
    ) -> None:
        """`root`: the run root (its store, run id and key). `members`: the parameters by fragment member (`ddiloco.learner.sharded`: live views, or a sharded
        model's whole values through collectives). `diloco`: the run's `download_codec` (not none: the syncer publishes download deltas, and a fragment
        one version behind takes one); None: none. `errors`: where the downloads' store errors and bugs are
        counted (a bug is raised again when its download is collected: `ddiloco.learner.health`)."""
        self.store, self.layout, self.members, self.copier, self.metrics = (
            root.store,
            layout,
            members,
            copier,
            metrics,
        )
        self.root, self.signer, self.learner_id, self.errors = root, root.signer, learner_id, errors
        self.deltas = diloco is not None and publishes_deltas(diloco.download_codec)
        self.held: dict[int, tuple[int, str]] = {}
        """p -> (version, digest) of the values in `anchors` (what a download delta must be based on)."""
        self.fetched: Counter[str] = Counter()
        """Downloads by kind: `delta`, `full` (the I/O pool's, after start-up)."""
        self._no_delta: set[tuple[int, int]] = set()
        self.device = copier.device
        self.anchors: Tensors = {}
        self.downloads: dict[int, Future] = {}
        self.rejected_globals: Counter[str] = Counter()
        self.bytes_down = 0
        self._bad: set[tuple[int, int]] = set()
        self.lock = threading.Lock()

    # --- start-up -------------------------------------------------------------------------------------------
    def wait_for_latest(self, timeout: float | None) -> list[int]:
        """Block until every fragment has a global version (the only wait besides the end of the run)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                versions = [latest_version(self.store, f.fragment_id) for f in self.layout.fragments]
                if all(v is not None for v in versions):
                    return [int(v) for v in versions]  # type: ignore[arg-type]
            except (StoreUnavailable, wire.PayloadError) as e:
                log.warning(
                    "learner %d: store unavailable while waiting for globals (%s)", self.learner_id, e
                )
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(
                    "global version 0 never appeared; is `ddiloco prepare` done for this store?"
                )
            time.sleep(0.2)

    def first(self, p: int, latest: int) -> Received:
        """The newest version ≤ latest of fragment p that verifies (a learner must start from a real one)."""
        for v in self._candidates(p, latest):
            try:
                got = read_global_full(self.store, self.signer, self.layout, p, v)
            except (wire.PayloadError, NotFound) as e:
                self._count_bad(p, v, getattr(e, "reason", "missing"), e)
                continue
            self._count_bytes(got.nbytes)
            return got
        raise wire.PayloadError("unusable", f"no version of fragment {p} verifies; check {signing.ENV_VAR}")

    def _candidates(self, p: int, latest: int) -> Iterator[int]:
        """`latest`, then, only if it fails, the older versions of p still in the store, newest first
        (retention prunes most of them: `ddiloco.config.retention`)."""
        yield latest
        prefix = keys.global_prefix(p)
        listed = {keys.version_of(k, prefix) for k in self.store.list(prefix)}
        yield from sorted((v for v in listed if v is not None and v < latest), reverse=True)

    # --- downloads ------------------------------------------------------------------------------------------
    def downloading(self, p: int) -> bool:
        return p in self.downloads

    def request(self, pool: ThreadPoolExecutor, p: int, version: int) -> None:
        """Start downloading `version` of p unless a download of p is under way or that version failed: its
        delta if p holds `version - 1` (and that delta was not refused), the full version otherwise."""
        if p in self.downloads or (p, version) in self._bad:
            return
        held = self.held.get(p, (-1, ""))[0]
        if self.deltas and held == version - 1 and (p, version) not in self._no_delta:
            self.downloads[p] = pool.submit(guard(self.errors, "download", self._download_delta), p, version)
        else:
            self.downloads[p] = pool.submit(guard(self.errors, "download", self._download), p, version)

    def collect(self, may_overwrite: Callable[[int], bool]) -> Iterator[tuple[int, Received]]:
        """(p, version received) of finished downloads that verified, for fragments `may_overwrite` allows
        now; the others stay until it does. A delta is applied here, to the values p holds, if they are its
        base (version and digest); otherwise it is refused (`base_mismatch`) and the full version is next."""
        for p, fut in list(self.downloads.items()):
            if not fut.done() or not may_overwrite(p):
                continue
            del self.downloads[p]
            try:
                version, got, unusable = fut.result()
            except StoreError as e:
                log.warning(
                    "learner %d: download of fragment %d failed (%s); will retry", self.learner_id, p, e
                )
                continue
            if unusable is not None:  # the delta was missing or refused; `got` is the full version
                self._no_delta.add((p, version))
                if isinstance(unusable, wire.PayloadError):
                    self.rejected_globals[f"delta_{unusable.reason}"] += 1
            if isinstance(got, wire.PayloadError):  # never retried: the next version is taken instead
                self._count_bad(p, version, got.reason, got)
            elif isinstance(got, GlobalDelta):
                applied = self._apply_delta(p, got)
                if applied is not None:
                    yield p, applied
            else:
                yield p, got

    def _apply_delta(self, p: int, delta: GlobalDelta) -> Received | None:
        """L_v = round(L_{v−1} + deq) on the device (`ddiloco.run.downlink`), or None if p does not hold its base."""
        if self.held.get(p) != (delta.base_version, delta.base_digest):
            self._no_delta.add((p, delta.version))
            self.rejected_globals["base_mismatch"] += 1
            self.metrics.rejected.labels(
                learner_id=str(self.learner_id), kind="global", reason="base_mismatch"
            ).inc()
            log.warning(
                "learner %d: refusing the delta of fragment %d v%d: it is based on v%d %s, this learner holds "
                "%s; fetching the full version",
                self.learner_id,
                p,
                delta.version,
                delta.base_version,
                delta.base_digest[:12],
                self.held.get(p),
            )
            return None
        with torch.no_grad():
            values = {n: apply_delta(self.anchors[n], d, delta.dtype) for n, d in delta.deq.items()}
        return Received(delta.version, values, delta.digest, delta.nbytes)

    def _download(self, p: int, version: int, unusable: Exception | None = None) -> Download:
        """(version, the full version or why it failed, `unusable`: why its delta was not taken, if tried)."""
        try:
            got = read_global_full(self.store, self.signer, self.layout, p, version)
        except wire.PayloadError as e:  # returned, not raised: the caller needs the version it concerns
            return version, e, unusable
        got = dataclasses.replace(got, tensors=pin(got.tensors, self.device))
        self._count_bytes(got.nbytes, "full")
        return version, got, unusable

    def _download_delta(self, p: int, version: int) -> Download:
        """The delta of `version`, or the full version when the delta is missing or does not verify (the
        loop thread counts it: every book of the feed is kept there)."""
        try:
            delta = read_global_delta(self.store, self.signer, self.layout, p, version)
        except (wire.PayloadError, NotFound) as e:
            log.warning(
                "learner %d: delta of fragment %d v%d unusable (%s); fetching the full version",
                self.learner_id,
                p,
                version,
                e,
            )
            return self._download(p, version, e)
        delta = dataclasses.replace(delta, deq=pin(delta.deq, self.device))
        self._count_bytes(delta.nbytes, "delta")
        return version, delta, None

    def _count_bytes(self, nbytes: int, kind: str | None = None) -> None:
        with self.lock:
            self.bytes_down += nbytes
            if kind is not None:
                self.fetched[kind] += 1
        self.metrics.downloaded.inc(nbytes)

    def _count_bad(self, p: int, version: int, reason: str, e: Exception) -> None:
        self._bad.add((p, version))
        self.rejected_globals[reason] += 1
        self.metrics.rejected.labels(learner_id=str(self.learner_id), kind="global", reason=reason).inc()
        log.warning(
            "learner %d: skipping global version %d of fragment %d (%s); training continues",
            self.learner_id,
            version,
            p,
            e,
        )

    # --- into the model -------------------------------------------------------------------------------------
    def overwrite(self, p: int, got: Received, mixing: float) -> None:
        """Mix a version of p into the parameters (α·local + (1-α)·global; α = 0 takes it as it is) and make
        it p's anchor (held: its version and digest)."""
        self.copier.fence()  # a checkpoint snapshot may still be reading the parameters
        values: Tensors = {}
        for name, t in got.tensors.items():
            values[name] = g = t.to(self.device, non_blocking=True)  # pinned by `_download` on CUDA
            self.anchors[name] = g.clone() if g is t else g
        self.members.write(values, mixing)
        self.held[p] = (got.version, got.digest)
