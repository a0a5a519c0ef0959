"""`ddiloco --version`: the package version and, when the package runs from a git checkout, its commit.

Design choices:
- The version is the installed distribution's (pyproject.toml), else `ddiloco.__version__` (a checkout on
  PYTHONPATH without an install).
- The commit is asked of git only where the package's parent folder is a checkout of this project (it holds
  `.git` and `pyproject.toml`): an installed package inside some other repository (a venv in a project) must
  not report that repository's commit. No checkout, no git, or git failing: "unknown", never an error.
- Computed when `--version` is given, not when the parser is built: other commands never start git.
"""

from __future__ import annotations

import argparse
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import ddiloco

CHECKOUT = Path(ddiloco.__file__).resolve().parents[1]


def package_version() -> str:
    try:
        return version("ddiloco")
    except PackageNotFoundError:
        return ddiloco.__version__


def commit(root: Path = CHECKOUT) -> str:
    """The checkout's commit (12 hex digits, `-dirty` with uncommitted changes), or "unknown"."""
    if not ((root / ".git").exists() and (root / "pyproject.toml").is_file()):
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=12", "--exclude=*"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def describe() -> str:
    return f"ddiloco {package_version()} (commit {commit()})"


class VersionAction(argparse.Action):
    """`--version`: print `describe()` and exit 0."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(describe())  # on stdout, as argparse's own version action
        parser.exit(0)
