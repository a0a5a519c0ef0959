"""`ddiloco learner --local-ranks N`: a learner's ranks on one host without torchrun, that live and die as one.

Design choices:
- The process started (by `ddiloco run`, or by hand) becomes rank 0: it takes a free loopback port, sets
  the torch distributed environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and starts
  ranks 1…N−1 as copies of its own command line, which then find WORLD_SIZE set and follow
  (`ddiloco.learner.ddp`).
- The ranks die with rank 0, as the processes of a pod die together: each follower asks the kernel for
  SIGKILL when its parent dies (Linux `PR_SET_PDEATHSIG`), so a chaos SIGKILL of the learner's process, or
  its crash, takes every rank down, and the supervisor's restart brings a whole new set of ranks (a new
  incarnation that rejoins). torchrun is not used here because its workers start in sessions of their own
  and outlive a killed agent.
- On a cluster the pod's command is still `torchrun --nproc-per-node=N` (its restarts are the pod's); this
  is for local runs and tests.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys

from ddiloco.platform.ports import free_port

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the ranks still end through their process group
        pass


def start_followers(ranks: int, argv: list[str] | None = None) -> list[subprocess.Popen]:
    """Make this process rank 0 of `ranks` and start the others (copies of `argv`, default this process's
    command line); none when `ranks` ≤ 1 or WORLD_SIZE is already set (torchrun, or a follower)."""
    if ranks <= 1 or "WORLD_SIZE" in os.environ:
        return []
    port = free_port()
    dist_env = {"WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    os.environ.update(dist_env, RANK="0", LOCAL_RANK="0")
    cmd = [sys.executable, *(argv if argv is not None else _own_argv())]
    procs = []
    for r in range(1, ranks):
        env = {**os.environ, **dist_env, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))  # noqa: PLW1509
    log.info("learner ranks 1..%d started (pids %s), port %d", ranks - 1, [p.pid for p in procs], port)
    return procs


def _own_argv() -> list[str]:
    """This process's arguments after the interpreter (`-m ddiloco.cli learner ...`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name.removesuffix(".__main__")
        return ["-m", module, *sys.argv[1:]]
    return list(sys.argv)


def reap(procs: list[subprocess.Popen], timeout: float = 30.0) -> list[int]:
    """Wait for the followers (rank 0 has sent STOP), kill any still running after `timeout`; exit codes."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            log.warning("learner rank (pid %d) did not stop; killing it", p.pid)
            p.kill()
            codes.append(p.wait())
    return codes
