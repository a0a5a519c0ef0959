"""The `ddiloco` command as a user types it, for tests: the console script in a subprocess, and one small
finished run made with it (session-scoped, shared by the entry-point and documented-command tests).

The console script is the one next to this interpreter (`pip install -e .` puts it there); without one,
`python -m ddiloco.cli`, which calls the same `ddiloco.cli.main:main`. PYTHONPATH starts with this checkout, so
the subprocess runs the code under test even where the installed distribution is another checkout's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests._harness import TINY

ROOT = Path(__file__).resolve().parents[1]
# Settings of the caller's shell that would point a command at another store or sign with another key.
SCRUB = (
    "DDILOCO_S3_", "AWS_", "MINIO_", "S3_ENDPOINT", "DDILOCO_RUN_KEY", "DDILOCO_LEARNER_KEY",
    "DDILOCO_SYNCER_PUBKEY", "DDILOCO_PUSHGATEWAY", "KFP_",
)  # fmt: skip
# A run of seconds: the harness's tiny model, 2 learners, a few thousand tokens.
TINY_RUN_SETS = [arg for item in (*TINY, "diloco.token_budget=6000") for arg in ("--set", item)]


def entry_point() -> list[str]:
    """argv[0:n] of the `ddiloco` console script of this environment (the real entry point)."""
    script = shutil.which("ddiloco", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "ddiloco.cli"]


def cli_env(**extra: str) -> dict[str, str]:
    """This process's environment without store/KFP settings, this checkout first on PYTHONPATH, one thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return {**env, **extra}


def ddiloco(
    *args: str, cwd: Path | str = ROOT, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run `ddiloco ARGS...` through the console script; the completed process (text output)."""
    return subprocess.run(
        [*entry_point(), *args],
        cwd=cwd,
        env=env or cli_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass(frozen=True, slots=True)
class CliRun:
    """A finished `ddiloco run --workdir WORKDIR --run-id r` of the tiny config."""

    workdir: Path
    root: Path
    """The run root (a file:// store), `WORKDIR/r`."""
    key: str
    """The run key `ddiloco run` kept in `WORKDIR/r.key` (the run is signed)."""
    result: subprocess.CompletedProcess[str]

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def env(self) -> dict[str, str]:
        """The environment of a command on this run: its key in DDILOCO_RUN_KEY."""
        return cli_env(DDILOCO_RUN_KEY=self.key)


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> CliRun:
    workdir = tmp_path_factory.mktemp("cli-run")
    # The global model's loss at 6 moments (TensorBoard: ≥ 5) needs ≥ 5 merged rounds whose versions the store
    # still holds: 6,000 tokens gave 3 rounds on a loaded machine (xdist's other worker busy), 12,000 twice that.
    curve = ("--set", "eval.curve_points=6", "--set", "diloco.token_budget=12000")
    peak = (
        "--set",
        "train.peak_flops=1e11",
    )  # a CPU has no data-sheet peak: MFU from a stated one (issue 52)
    sets = (*TINY_RUN_SETS, *curve, *peak)
    result = ddiloco("run", "--workdir", str(workdir), "--run-id", "r", *sets, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return CliRun(workdir, workdir / "r", (workdir / "r.key").read_text().strip(), result)
