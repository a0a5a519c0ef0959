"""The syncer's pruning of the run store: after each merge, the fragment's global and momentum versions that
the retention rules (`ddiloco.config.retention`) no longer keep are deleted.

Called once per merge, after the merge is fully persisted, so nothing a restart adopts is ever pruned. The
curve's moments are a small JSON document (`keys.RETENTION`) written before anything they stop pinning is
deleted, so they survive restarts. Pruning lists the fragment's prefixes and deletes what is not kept, so
whatever a failed delete or a crash left goes at the next merge; a store error is logged, never fatal.
`keeps` is the rule the intake applies to an answer's base (`pruned_base`).

Design notes: docs/internals.md, "Pruning the store".
"""

from __future__ import annotations

import logging
from typing import Any

from ddiloco import keys
from ddiloco.config.retention import RetentionConfig, curve_stride, kept_versions, pinned_by, window
from ddiloco.store.base import Store, StoreError

log = logging.getLogger(__name__)


class Retention:
    """Keeps one run store bounded (see the module docstring); `cfg` None keeps everything."""

    def __init__(self, store: Store, cfg: RetentionConfig | None, num_fragments: int) -> None:
        self.store, self.cfg, self.P = store, cfg, num_fragments
        self.moments: dict[int, list[int]] = {0: [0] * num_fragments}
        if cfg is not None:
            self.moments.update(self._read())

    def _read(self) -> dict[int, list[int]]:
        try:
            doc: Any = self.store.get_json_or_none(keys.RETENTION)
            moments = {int(n): [int(v) for v in vs] for n, vs in (doc or {}).get("moments", {}).items()}
        except (StoreError, ValueError, TypeError, AttributeError) as e:
            log.error("syncer: %s unreadable (%s); curve moments start afresh", keys.RETENTION, e)
            return {}
        return {n: vs for n, vs in moments.items() if len(vs) == self.P}

    def keeps(self, p: int, version: int, latest: int) -> bool:
        """Whether version `version` of fragment p is kept while `latest` is its newest."""
        if self.cfg is None:
            return True
        return version in kept_versions(latest, pinned_by(self.moments, p), self.cfg.keep_latest)

    def after_merge(self, p: int, versions: list[int], merges: int) -> None:
        """The syncer's `merges`-th merge published `versions[p]` of fragment p: remember the moment if it is
        one the curve keeps, then prune fragment p."""
        if self.cfg is None:
            return
        try:
            self._remember(self.cfg.curve_moments, list(versions), merges)
            self.prune(p, versions[p])
        except StoreError as e:
            log.warning("syncer: pruning fragment %d deferred to its next merge (%s)", p, e)

    def _remember(self, limit: int, versions: list[int], merges: int) -> None:
        """Add the moment after `merges` merges if the stride keeps it, drop those it no longer keeps; the
        document is written before anything they stop pinning is deleted."""
        stride = curve_stride(merges, limit)
        moments = {n: vs for n, vs in self.moments.items() if n % stride == 0}
        if merges % stride == 0:
            moments[merges] = versions
        if moments != self.moments:
            doc = {
                "stride": stride,
                "merges": merges,
                "moments": {str(n): vs for n, vs in sorted(moments.items())},
            }
            self.store.put_json(keys.RETENTION, doc)
            self.moments = moments

    def prune(self, p: int, latest: int) -> int:
        """Delete fragment p's global and momentum versions that are not kept; returns how many."""
        cfg = self.cfg
        if cfg is None:
            return 0
        keep = kept_versions(latest, pinned_by(self.moments, p), cfg.keep_latest)
        newest = set(window(latest, cfg.keep_latest))
        deleted = self._delete_except(keys.global_prefix(p), keep, latest)
        # A download delta serves a learner one version behind: only the newest ones are of use.
        deleted += self._delete_except(keys.global_prefix(p), newest, latest, letter="d")
        deleted += self._delete_except(keys.momentum_prefix(p), newest, latest)
        deleted += self._delete_except(keys.master_prefix(p), newest, latest)
        if deleted:
            log.debug("syncer: pruned %d objects of fragment %d (kept %s)", deleted, p, sorted(keep))
        return deleted

    def _delete_except(self, prefix: str, keep: set[int], latest: int, letter: str = "v") -> int:
        """Delete the versions under `prefix` up to `latest` that `keep` does not hold. Never one newer than
        `latest`: pruning runs on the cleaner's thread while the publisher may be writing the fragment's next
        version (its global, delta, momentum and master land before its pointer), which a listing shows."""
        doomed = [
            k
            for k in self.store.list(prefix)
            if (v := keys.version_of(k, prefix, letter)) is not None and v <= latest and v not in keep
        ]
        for key in doomed:
            self.store.delete(key)
        return len(doomed)
