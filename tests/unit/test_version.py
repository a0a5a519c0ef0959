"""`ddiloco --version`'s commit: the checkout's, or "unknown" (never an error) where there is none."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.cli.version import commit


def test_no_checkout_is_unknown(tmp_path: Path):
    assert commit(tmp_path) == "unknown"


def test_a_broken_checkout_or_no_git_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / ".git").mkdir()  # not a repository
    (tmp_path / "pyproject.toml").write_text("")
    assert commit(tmp_path) == "unknown"
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable
    assert commit(Path(__file__).resolve().parents[2]) == "unknown"


def test_a_repository_without_the_project_is_not_asked(tmp_path: Path):
    """A package installed inside some other repository (a venv in a project) does not report its commit."""
    (tmp_path / ".git").mkdir()
    assert commit(tmp_path) == "unknown"
