"""Bounded storage: which global and outer-momentum versions a run keeps, and the run config's `retention` section.

Pure rules (no store, no torch); `ddiloco.syncer.retention` applies them after each merge. Per fragment the
run keeps the newest `keep_latest` versions (also the staleness the syncer accepts: an older base is
`pruned_base`) and the versions of the curve's moments, the global model right after the syncer's n-th
merge for n = 0, s, 2s, … with the stride s the smallest power of two that leaves at most `curve_moments`
of them (`curve_stride`); of the outer momentum only the newest `keep_latest`. So storage is bounded
whatever the run's length (16 global versions per fragment at the defaults), and every curve point is a
model that existed. `retention: null` keeps every version.

Design notes (why doubling strides, not log spacing; the sizes): docs/internals.md,
"Which versions the store keeps".
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
