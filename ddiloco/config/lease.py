"""The `lease` section of the run config: how long the syncer's lease lasts and how it is renewed.

It lives on the config's floor (the lease itself is `ddiloco.syncer.lease`), so the config never imports
the syncer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class LeaseConfig:
    min_s: float = 5.0
    """Shortest lease in seconds, whatever the measured cadence and latency."""
    factor: float = 3.0
    """lease_s = max(min_s, factor × (renew_every_s + store latency + merge-and-publish time))."""
    renew_every_s: float = 1.0
    """How often the holder renews; standbys poll twice as often."""
    stuck_s: float = 300.0
    """The renewal thread stops renewing when the syncer's loop made no pass for this long (a hung syncer
    must not keep its lease); longer than any one merge, publish or store retry at the largest preset."""

    def validate(self) -> None:
        if self.stuck_s < self.min_s:
            raise ConfigError(f"lease.stuck_s={self.stuck_s} must be at least lease.min_s={self.min_s}")
        if not (self.renew_every_s > 0 and self.min_s >= 2 * self.renew_every_s):
            raise ConfigError(
                f"lease.min_s={self.min_s} must be at least twice lease.renew_every_s={self.renew_every_s} "
                "(> 0): a lease has to outlast a renewal interval"
            )
        if self.factor < 2:
            raise ConfigError(f"lease.factor={self.factor} must be ≥ 2 (3 rides out two missed renewals)")
