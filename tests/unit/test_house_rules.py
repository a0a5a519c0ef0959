"""Rules the codebase keeps (DESIGN §3, STYLE): checked, not hoped for."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = sorted((ROOT / "ddiloco").rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_library_never_imports_kfp():
    offenders = [str(p.relative_to(ROOT)) for p in LIBRARY if {"kfp"} & _imports(p)]
    assert not offenders


def test_no_pickle_based_loading_in_the_library():
    for path in LIBRARY:
        text = path.read_text()
        assert "pickle" not in _imports(path), path
        assert "torch.load(" not in text, f"{path}: use safetensors, never torch.load"


def test_importing_the_package_has_no_side_effects():
    code = (
        "import logging, os; before = dict(os.environ); import ddiloco.cli.main, ddiloco.learner.loop, ddiloco.syncer.loop; "
        "assert dict(os.environ) == before; assert not logging.getLogger().handlers"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_library_files_stay_small_and_print_free():
    for path in LIBRARY:
        lines = path.read_text().splitlines()
        assert len(lines) <= 600, f"{path} has {len(lines)} lines; split it by responsibility"
        if "cli" not in path.parts and path.stem != "cli" and "report" not in path.name:  # front ends print
            assert not any(line.lstrip().startswith("print(") for line in lines), (
                f"{path}: use logging, not print"
            )
