"""Failpoints: make a process crash (or fail) at a named point, for tests and the soak benchmark.

`DDILOCO_FAILPOINT` holds one or more comma-separated `<site>:<step>:<action>[@<n>]` and is read once, by
`load_env`, when the syncer starts (`ddiloco.cli.roles`). Unset, `hit` costs one test of an empty dict.
The points of site `publish` are the writes of one merge, each firing right after its write: `after_momentum`,
`after_master`, `after_record`, `after_delta`, `after_global`, `after_pointer`, `after_status`,
`after_state`. Actions: `kill` (SIGKILL: a real crash), `raise` (`FailpointCrash`, a BaseException nothing
in the library catches) and `store_error` (`StoreUnavailable`, which the syncer's loop retries). `@n` fires
at the n-th time the point is reached (default 1); with `DDILOCO_FAILPOINT_ONCE=<path>` a point fires only
if this process creates that file, so once per run however often the process restarts.

Details (which write each point follows): docs/internals.md, "Failpoints".
"""

from __future__ import annotations

import logging
import os
import signal

from ddiloco.store.base import StoreUnavailable

__all__ = ["ENV_VAR", "ONCE_ENV_VAR", "FailpointCrash", "arm", "disarm", "hit", "load_env"]

log = logging.getLogger(__name__)

ENV_VAR = "DDILOCO_FAILPOINT"
ONCE_ENV_VAR = "DDILOCO_FAILPOINT_ONCE"
STEPS = {
    "publish": (
        "after_momentum",
        "after_master",
        "after_record",
        "after_delta",
        "after_global",
        "after_pointer",
        "after_status",
        "after_state",
    )
}
ACTIONS = ("kill", "raise", "store_error")

_armed: dict[tuple[str, str], list] = {}
"""(site, step) -> [action, the hit it fires at, hits so far]."""
_once_path: str | None = None


class FailpointCrash(BaseException):
    """Raised by a failpoint armed with `raise`: an in-process stand-in for a crash."""


def arm(site: str, step: str, action: str, nth: int = 1) -> None:
    """Fire `action` the `nth` time (site, step) is reached in this process."""
    if step not in STEPS.get(site, ()):
        raise ValueError(f"unknown failpoint {site}:{step}; known: {STEPS}")
    if action not in ACTIONS:
        raise ValueError(f"unknown failpoint action {action!r}; known: {', '.join(ACTIONS)}")
    if nth < 1:
        raise ValueError(f"failpoint {site}:{step}: @{nth} must be ≥ 1")
    _armed[(site, step)] = [action, nth, 0]


def disarm() -> None:
    """Disarm every failpoint."""
    _armed.clear()


def load_env(env: dict[str, str] | None = None) -> None:
    """Arm what `DDILOCO_FAILPOINT` names (ValueError naming the bad entry); nothing when it is unset."""
    global _once_path
    env = dict(os.environ) if env is None else env
    spec = env.get(ENV_VAR, "").strip()
    _once_path = env.get(ONCE_ENV_VAR) or None
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        point, _, nth = entry.partition("@")
        parts = point.split(":")
        if len(parts) != 3 or (nth and not nth.isdigit()):
            raise ValueError(f"{ENV_VAR}: {entry!r} is not <site>:<step>:<action>[@<n>]")
        arm(*parts, nth=int(nth) if nth else 1)
        log.warning("failpoint armed: %s", entry)


def hit(site: str, step: str) -> None:
    """Reached (site, step): fire its action if armed for this hit."""
    if not _armed:
        return
    armed = _armed.get((site, step))
    if armed is None:
        return
    armed[2] += 1
    if armed[2] != armed[1] or not _first_in_run():
        return
    log.warning("failpoint %s:%s fires: %s", site, step, armed[0])
    if armed[0] == "kill":
        for h in logging.getLogger().handlers:  # the line above is the last this process writes
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if armed[0] == "raise":
        raise FailpointCrash(f"failpoint {site}:{step}")
    raise StoreUnavailable(f"failpoint {site}:{step}")


def _first_in_run() -> bool:
    if _once_path is None:
        return True
    try:
        os.close(os.open(_once_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
