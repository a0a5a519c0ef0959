"""The run config's `chaos:` section (`RunConfig.chaos`), next to the module that parses its events.

Design choices:
- Lives here, not in `ddiloco.config.run`, like the other feature sections (`link`, `retention`, `lease`): the
  schema sits beside the rules that read it, and this module never imports the config.
- `validate` checks what the events parser does not (the Poisson section's learner ids), then parses the
  whole schedule (`schedule_from_config`), which raises `ChaosConfigError` naming the bad event.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddiloco.config.chaos_schedule import ChaosConfigError, schedule_from_config


@dataclass(kw_only=True, slots=True)
class PoissonKillsConfig:
    mean_interval_s: float = 60.0
    """Mean seconds between random learner kills (exponential gaps)."""
    seed: int = 0
    """Seed of the kill times and victims."""
    start_s: float = 10.0
    """No random kill before this many seconds into the run."""
    stop_s: float | None = None
    """No random kill after this many seconds (default: one hour)."""
    learners: list[int] | None = None
    """Learner ids that may be hit (default: all provisioned learners)."""


@dataclass(kw_only=True, slots=True)
class ChaosConfig:
    events: list[dict] = field(default_factory=list)
    """Scheduled events, e.g. {kind: kill_learner, learner: 1, at_s: 30} or {kind: kill_learner, learner: 1,
    at_step: 200}; kinds: kill_learner, stall_learner (at_s, duration_s), slow_learner (factor, jitter),
    kill_syncer (at_s), store_outage (at_s, duration_s), add_learner (learner, at_s). Times count from the
    end of `prepare`."""
    poisson: PoissonKillsConfig | None = None
    """Random learner kills (Poisson process); null for none."""

    def validate(self, learners: int) -> None:
        """Check the schedule a run with `learners` provisioned learners would fire
        (`ddiloco.config.chaos_schedule`)."""
        p = self.poisson
        if p is not None and p.learners is not None:
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p.learners):
                raise ChaosConfigError("chaos.poisson.learners must be learner ids (integers ≥ 0)")
        schedule_from_config(self, learners)
