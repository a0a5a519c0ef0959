"""The chaos backends on one machine: the processes `ddiloco run` started, and role processes by pid.

Design choices:
- `LaunchedProcesses` acts on the children of a `LocalRun` (`ddiloco.launch`), which also restarts what
  it kills: real SIGKILL, SIGSTOP/SIGCONT for a stall, a new learner process for `add_learner`. A victim
  that is not running (between restarts) is skipped at once, not waited for: the launcher knows its children.
- `LocalPids` is the `ddiloco chaos --backend local` step for roles started by hand on this machine
  (`ddiloco learner|syncer --store URL`): SIGKILL by the pid a role reported, only on this host and only for
  a process whose command line is the expected `ddiloco learner|syncer` role on this store (pids are
  reused; a stale report must not kill a stranger).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Protocol

from ddiloco.chaos.runner import Outcome
from ddiloco.chaos.victims import ReportedVictims
from ddiloco.config.chaos_schedule import ChaosEvent
from ddiloco.platform.hostname import host_name
from ddiloco.store.base import Store


class Child(Protocol):
    """A process the launcher supervises (`ddiloco.launch.Proc`); `popen` is None between restarts."""

    popen: subprocess.Popen | None


class Launcher(Protocol):
    """What chaos needs of a `LocalRun`."""

    def find(self, role: str, learner_id: int | None = None) -> Child | None: ...

    def add_learner(self, learner_id: int) -> Child: ...


def _running(child: Child | None) -> subprocess.Popen | None:
    popen = child.popen if child is not None else None
    return popen if popen is not None and popen.poll() is None else None


class LaunchedProcesses:
    """Fires timed events at the processes of a `LocalRun` (real SIGKILL / SIGSTOP / SIGCONT)."""

    name = "launcher"
    persist = False
    fires = frozenset({"kill_learner", "kill_syncer", "stall_learner", "add_learner", "store_outage"})
    cannot: dict[str, str] = {}

    def __init__(self, run: Launcher) -> None:
        self.run = run

    def fire(self, ev: ChaosEvent, store: Store) -> Outcome:
        if ev.kind == "add_learner" and ev.learner is not None:
            self.run.add_learner(ev.learner)
            return Outcome("started")
        if ev.kind == "store_outage":
            return Outcome(f"outage for {ev.duration_s}s (every process refuses store calls)")
        child = self.run.find(ev.role(), ev.learner)
        popen = _running(child)
        if popen is None:
            return Outcome("skipped (not running)")
        if ev.kind == "stall_learner":
            popen.send_signal(signal.SIGSTOP)
            return Outcome("SIGSTOP", {"pid": popen.pid}, resume=lambda: _resume(child))
        popen.send_signal(signal.SIGKILL)
        return Outcome("SIGKILL", {"pid": popen.pid})


def _resume(child: Child | None) -> bool:
    """SIGCONT to a stalled child if it still runs (a restart may have replaced its process meanwhile)."""
    popen = _running(child)
    if popen is not None:
        popen.send_signal(signal.SIGCONT)
    return popen is not None


class LocalPids(ReportedVictims):
    """SIGKILL by pid for roles started by hand on this machine (`ddiloco learner|syncer --store URL`)."""

    name = "local"

    def __init__(self, store_url: str, proc_root: str = "/proc") -> None:
        self.store_url, self.proc_root, self.hostname = store_url, Path(proc_root), host_name()

    def _cmdline(self, pid: int) -> list[str]:
        try:
            return (self.proc_root / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return []

    def kill(self, role: str, host: str, pid: int | None) -> Outcome | None:
        if host != self.hostname or pid is None:
            return None
        argv = self._cmdline(pid)
        if role not in argv or self.store_url not in argv or not any("ddiloco" in a for a in argv):
            return None  # exited, or the pid now belongs to another process
        os.kill(pid, signal.SIGKILL)
        return Outcome("SIGKILL", {"pid": pid, "host": host})
