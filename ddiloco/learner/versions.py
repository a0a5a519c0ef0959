"""Global versions into a learner: waited for at start, downloaded off the loop, verified, mixed into the model.

Design choices:
- A learner never trains from a random init: `wait_for_latest` blocks until every fragment has a version,
  and `first` takes the newest of them that verifies (an older one still in the store when the newest does
  not).
- Downloads run on the learner's I/O pool (passed in by the caller, who owns it); the loop only collects the
  finished ones, at a step boundary, and only for fragments the caller says may be overwritten now.
- A version that fails verification is never retried: it is logged, counted by reason (`rejected_globals`)
  and skipped until a newer one appears. A store error is retried with the next request.
- The anchor copies of the tensors (what an answer's delta is taken against) live here, next to the
  parameters they overwrite.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ddiloco import keys
from ddiloco.globalmodel import Layout, latest_version, read_global
from ddiloco.learner.accel import HostCopier, pin
from ddiloco.metrics import LearnerMetrics
from ddiloco.protocol import signing, wire
from ddiloco.store.base import NotFound, Store, StoreError, StoreUnavailable

__all__ = ["VersionFeed"]

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]


class VersionFeed:
    """Fragments' global versions for one learner; `anchors`: the versions received, on the device."""

    def __init__(
        self,
        store: Store,
        layout: Layout,
        params: dict[str, torch.Tensor],
        copier: HostCopier,
        metrics: LearnerMetrics,
        *,
        run_id: str,
        learner_id: int,
        key: bytes | None,
    ) -> None:
        self.store, self.layout, self.params, self.copier, self.metrics = (
            store,
            layout,
            params,
            copier,
            metrics,
        )
        self.run_id, self.learner_id, self.key = run_id, learner_id, key
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

    def first(self, p: int, latest: int) -> tuple[int, Tensors]:
        """The newest version ≤ latest of fragment p that verifies (a learner must start from a real one)."""
        for v in self._candidates(p, latest):
            try:
                return v, read_global(self.store, self.run_id, self.layout, p, v, key=self.key)
            except (wire.PayloadError, NotFound) as e:
                self._count_bad(p, v, getattr(e, "reason", "missing"), e)
        raise wire.PayloadError("unusable", f"no version of fragment {p} verifies; check {signing.ENV_VAR}")

    def _candidates(self, p: int, latest: int) -> Iterator[int]:
        """`latest`, then, only if it fails, the older versions of p still in the store, newest first
        (retention prunes most of them: `ddiloco.retention`)."""
        yield latest
        prefix = keys.global_prefix(p)
        listed = {keys.version_of(k, prefix) for k in self.store.list(prefix)}
        yield from sorted((v for v in listed if v is not None and v < latest), reverse=True)

    # --- downloads ------------------------------------------------------------------------------------------
    def downloading(self, p: int) -> bool:
        return p in self.downloads

    def request(self, pool: ThreadPoolExecutor, p: int, version: int) -> None:
        """Start downloading `version` of p unless a download of p is under way or that version failed."""
        if p not in self.downloads and (p, version) not in self._bad:
            self.downloads[p] = pool.submit(self._download, p, version)

    def collect(self, may_overwrite: Callable[[int], bool]) -> Iterator[tuple[int, int, Tensors]]:
        """(p, version, tensors) of finished downloads that verified, for fragments `may_overwrite` allows
        now; the others stay until it does."""
        for p, fut in list(self.downloads.items()):
            if not fut.done() or not may_overwrite(p):
                continue
            del self.downloads[p]
            try:
                version, tensors = fut.result()
            except StoreError as e:
                log.warning(
                    "learner %d: download of fragment %d failed (%s); will retry", self.learner_id, p, e
                )
                continue
            if isinstance(tensors, wire.PayloadError):  # never retried: the next version is taken instead
                self._count_bad(p, version, tensors.reason, tensors)
            else:
                yield p, version, tensors

    def _download(self, p: int, version: int) -> tuple[int, Tensors | wire.PayloadError]:
        try:
            tensors = read_global(self.store, self.run_id, self.layout, p, version, key=self.key)
        except wire.PayloadError as e:  # returned, not raised: the caller needs the version it concerns
            return version, e
        tensors = pin(tensors, self.device)
        size = sum(t.numel() * 4 for t in tensors.values())
        with self.lock:
            self.bytes_down += size
        self.metrics.downloaded.inc(size)
        return version, tensors

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
    def overwrite(self, p: int, tensors: Tensors, mixing: float) -> None:
        """Mix a version of p into the parameters (α·local + (1-α)·global; α = 0 takes it as it is) and make
        it p's anchor."""
        self.copier.fence()  # a checkpoint snapshot may still be reading the parameters
        with torch.no_grad():
            for name, t in tensors.items():
                g = t.to(self.device, non_blocking=True)  # pinned by `_download` on CUDA
                if mixing > 0:
                    self.params[name].mul_(mixing).add_(g, alpha=1 - mixing)
                else:
                    self.params[name].copy_(g)
                self.anchors[name] = g.clone() if g is t else g
