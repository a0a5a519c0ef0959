"""The run config's `link` section: a learner's emulated link to the store (`ddiloco.store.shaped` models it)."""

from __future__ import annotations

import dataclasses

from ddiloco.errors import ConfigError
from ddiloco.store.shaped import Link


@dataclasses.dataclass(kw_only=True, slots=True)
class LinkConfig:
    """The run config's `link` section (`RunConfig.link`): on when present, like every optional feature."""

    bandwidth: str | None = None
    """Each learner's link to the store, per direction: 10Mbit, 100Mbit, 1Gbit (bits/s) or 5MB/s; null: unlimited."""
    latency: str | None = None
    """Added one-way latency, e.g. 50ms (each store request pays a round trip); null: none."""

    def validate(self) -> None:
        try:
            Link.parse(self.bandwidth, self.latency)
        except ValueError as e:
            raise ConfigError(f"link: {e}") from None
