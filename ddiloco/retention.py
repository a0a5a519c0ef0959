"""Bounded storage: which global and outer-momentum versions a run keeps, and the run config's `retention` section.

Pure rules (no store, no torch); `ddiloco.syncer.retention` applies them after each merge.

What is kept, per fragment p, once the syncer has published version `latest` of p:
- the newest `keep_latest` versions, latest − keep_latest + 1 … latest. This is also the syncer's accepted
  staleness: an answer whose base version is older than that window and not kept for another reason is
  rejected as `pruned_base` (`ddiloco.protocol.validation`), whether or not the object is still there, so the
  rule never depends on how far pruning has got;
- the versions of the curve's moments: a moment is "the global model right after the syncer's n-th merge"
  (n = 0: version 0 of every fragment, so version 0 is always kept, also for the data-parallel baseline,
  which starts from it), and the syncer keeps the moments n = 0, s, 2s, … up to the merges so far, with the
  stride s the smallest power of two that leaves at most `curve_moments` of them (`curve_stride`);
- outer momentum: only the newest `keep_latest` versions (a restarted syncer resumes at the latest; momentum
  has no use for the loss curve).

Design choices:
- Evenly spaced moments whose spacing doubles when full, rather than log-spaced versions: the number kept is
  bounded whatever the run's length (which nobody knows in advance: the budget is in tokens, learners come and
  go), between curve_moments/2 + 1 and curve_moments, and the points stay evenly spaced in merges, which is
  how `ddiloco.posttrain.evaluate.curve_points` spaces a curve. Log spacing grows without bound (slowly) and
  crowds the points into the first minutes of a curve drawn on a linear axis.
- A moment pins one version of *every* fragment at the same instant, so each curve point is a model that
  existed; per-fragment "every N-th version" would not line up across fragments once a round is abandoned.
- Per fragment at most keep_latest + curve_moments global versions (16 at the defaults: 4 + 12; 12 moments
  leave ≥ 7 after a doubling, plus the run's end: the report's 8 curve points) and keep_latest momentum
  versions. At the 350m paper-like recipe that is ~16 × 29 MB per fragment instead of ~3,200 versions.
- `retention: null` keeps every version and its objects, for studies that need every version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ddiloco.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class RetentionConfig:
    """The run config's `retention` section (`RunConfig.retention`); null keeps every version."""

    keep_latest: int = 4
    """Newest global and outer-momentum versions kept per fragment; also the accepted staleness: an answer
    whose base is older (and not kept for the curve) is rejected as `pruned_base`. At least 2."""
    curve_moments: int = 12
    """Most moments (the global model after the syncer's n-th merge, one version of every fragment) kept for
    the post-hoc validation-loss curve, evenly spaced in merges; the spacing doubles when full. At least 2."""

    def validate(self) -> None:
        if self.keep_latest < 2:
            raise ConfigError(
                f"retention.keep_latest={self.keep_latest} must be ≥ 2 (an answer's base is often the "
                "version before the latest); use retention=null to keep everything"
            )
        if self.curve_moments < 2:
            raise ConfigError(
                f"retention.curve_moments={self.curve_moments} must be ≥ 2 (start and one more)"
            )

    def max_versions(self) -> int:
        """The most global versions of one fragment the store holds under this config."""
        return self.keep_latest + self.curve_moments


def curve_stride(merges: int, moments: int) -> int:
    """The smallest power of two s such that the moments 0, s, 2s, … ≤ `merges` are at most `moments`."""
    stride = 1
    while merges // stride + 1 > moments:
        stride *= 2
    return stride


def curve_moments(merges: int, moments: int) -> list[int]:
    """The merge counts n of the moments kept after `merges` merges (`curve_stride`)."""
    return list(range(0, merges + 1, curve_stride(merges, moments)))


def window(latest: int, keep_latest: int) -> range:
    """The newest `keep_latest` versions up to `latest`."""
    return range(max(0, latest - keep_latest + 1), latest + 1)


def kept_versions(latest: int, pinned: Iterable[int], keep_latest: int) -> set[int]:
    """Global versions of one fragment to keep: its newest `keep_latest`, the versions its curve moments
    `pinned`, and version 0."""
    return {0, *window(latest, keep_latest), *pinned}


def pinned_by(moments: Mapping[int, list[int]], fragment_id: int) -> set[int]:
    """The versions of `fragment_id` that the curve `moments` (merge count -> versions) pin."""
    return {versions[fragment_id] for versions in moments.values()}
