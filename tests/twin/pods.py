"""A pod's main container as a local process group, and the guarantee that none outlives its run.

Design choices:
- One pod = one `subprocess.Popen(..., start_new_session=True)`: the container's processes are the process
  group, signals go to the group (like a container runtime signalling the container's PID namespace).
- stdout and stderr go to one log file, as the KFP launcher wires both to the same writer
  (launcher_v2.go execute: command.Stdout = command.Stderr = writer).
- Every pod process carries TWIN_POD_UID and TWIN_RUN_ID in its environment. When a pod ends (its main
  process exited, or it was killed) every process still carrying its TWIN_POD_UID - including ones that
  left the process group - is SIGKILLed, as a container's teardown kills everything in it; `stragglers(run)`
  finds whatever a run left behind, for cleanup and for tests.
- A task pod's main process is Argo's emissary's child: when it exits, the emissary notices at its next
  wait4 poll, once a second from the start (argo-workflows v4.0.5 workflow/executor/osspecific/
  signal_darwin.go Wait, which signal_linux.go links to: Wait4 WNOHANG, then sleep one second), and only then
  does the container end and its remaining processes die. With `emissary=True` a PodProcess whose main
  process exits while other processes of the pod live reports its end (and kills them) at that poll.
- `python3` is the twin's interpreter: `<venv>/bin` is put first on PATH. `_site/sitecustomize.py` (on
  PYTHONPATH) makes socket.gethostname() return the pod hostname: a stand-in, see that file.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

SITE_DIR = Path(__file__).resolve().parent / "_site"
PASS_THROUGH = ("HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "USER")


def base_env(python_bin: Path) -> dict[str, str]:
    """What a container starts with before the pod's own variables: PATH with the twin's Python first, and a
    few locale/threading variables of this process. Nothing else leaks in (no KUBERNETES_SERVICE_HOST, no
    KUBECONFIG, no cloud credentials)."""
    env = {k: os.environ[k] for k in PASS_THROUGH if k in os.environ}
    env["PATH"] = os.pathsep.join([str(python_bin), "/usr/local/bin", "/usr/bin", "/bin"])
    env["PYTHONPATH"] = str(SITE_DIR)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def default_python_bin() -> Path:
    return (
        Path(sys.executable).resolve().parent if sys.prefix == sys.base_prefix else Path(sys.prefix) / "bin"
    )


class PodProcess:
    """The running main container of one pod."""

    def __init__(
        self, argv: list[str], env: dict[str, str], cwd: Path, log_path: Path, emissary: bool = False
    ) -> None:
        self.uid, self.emissary, self.started = env["TWIN_POD_UID"], emissary, time.monotonic()
        self.exited: tuple[int, float] | None = None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in reap)
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.kill_at: float | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            rc = self.proc.poll()
            if rc is not None and self.emissary and self.exited is None and marked("TWIN_POD_UID", self.uid):
                since = time.monotonic() - self.started
                self.exited = (rc, self.started + math.floor(since) + 1.0)  # the emissary's next poll
            if self.exited is not None:
                if time.monotonic() >= self.exited[1]:
                    self.reap(self.exited[0])
            elif rc is not None:
                self.reap(rc)
        if self.returncode is None and self.kill_at is not None and time.monotonic() >= self.kill_at:
            self.signal(signal.SIGKILL)
        return self.returncode

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self, grace_s: float) -> None:
        """SIGTERM now, SIGKILL after the grace period (a container stop)."""
        if self.returncode is None:
            self.signal(signal.SIGTERM)
            self.kill_at = (
                time.monotonic() + grace_s
                if self.kill_at is None
                else min(self.kill_at, time.monotonic() + grace_s)
            )

    def kill(self) -> None:
        """SIGKILL the group now and wait for the main process (a force delete, a node loss)."""
        if self.returncode is None:
            self.signal(signal.SIGKILL)
            try:
                rc = self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                rc = -9
            self.reap(rc)

    def reap(self, rc: int) -> None:
        self.returncode = rc
        self.signal(signal.SIGKILL)
        kill_marked("TWIN_POD_UID", self.uid)
        self._log.close()


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def marked(key: str, value: str) -> list[int]:
    """Pids of this user's processes whose environment has key=value."""
    needle = f"{key}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            if needle in _environ(int(entry.name)).split(b"\0"):
                pids.append(int(entry.name))
    return pids


def kill_marked(key: str, value: str, rounds: int = 3) -> None:
    for _ in range(rounds):
        pids = marked(key, value)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
    left = marked(key, value)
    if left:
        log.warning("twin: processes %s with %s=%s survived SIGKILL", left, key, value)


def stragglers(run_id: str) -> list[int]:
    """Processes a twin run left behind (none, after the run ended)."""
    return [p for p in marked("TWIN_RUN_ID", run_id) if not _is_zombie(p)]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True
