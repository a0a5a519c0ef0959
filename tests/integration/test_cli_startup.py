"""Commands that read no model or codec start without torch: importing it costs ~1.5-4 s of CPU in every
process (`ddiloco --version` took 4.5 CPU-s on a loaded machine, 0.4 now). Run through the real entry point
with a `torch` package on the path that refuses to import, so a command that reaches for it fails here."""

from __future__ import annotations

import os
from pathlib import Path

from tests._cli import ROOT, cli_env, ddiloco

LIGHT = (
    ("--version",),
    ("--help",),
    ("simulate", "goodput", "--json"),
    ("keys",),
    ("run", "--help"),
)


def _no_torch(tmp_path: Path) -> dict[str, str]:
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('torch was imported')\n")
    return cli_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]), DDILOCO_RUN_KEY="5c" * 32)


def test_commands_that_read_no_model_do_not_import_torch(tmp_path: Path):
    env = _no_torch(tmp_path)
    for args in LIGHT:
        out = ddiloco(*args, env=env, timeout=60)
        assert out.returncode == 0, (args, out.stderr[-2000:])
    # The stand-in works: a command that encodes sizes with a codec does import torch, and fails here.
    out = ddiloco("simulate", "bandwidth", "--dtype", "int4", "--json", env=env, timeout=60)
    assert out.returncode != 0 and "torch was imported" in out.stderr
    # and with torch, the same command works; a misspelt codec is refused by name, with the choices
    out = ddiloco("simulate", "bandwidth", "--dtype", "int5")
    assert out.returncode == 2 and "invalid choice: 'int5'" in out.stderr and "'int4'" in out.stderr
