"""Rules the codebase keeps (issue 15): checked, not hoped for.

The library is `ddiloco/` plus `components/` and `pipelines/` (installed as `ddiloco.components` and
`ddiloco.pipelines`); the structural rules cover all three, the import rules the core package `ddiloco/`.
"""

import ast
import subprocess
import sys
from pathlib import Path

from tests.import_graph import arrows_up, describe_cycles, library_modules, wing_of

ROOT = Path(__file__).resolve().parents[2]
CORE = sorted((ROOT / "ddiloco").rglob("*.py"))
LIBRARY = sorted(
    p for folder in ("ddiloco", "components", "pipelines") for p in (ROOT / folder).rglob("*.py")
)
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_library_never_imports_kfp():
    offenders = [_rel(p) for p in CORE if {"kfp"} & _imports(p)]
    assert not offenders


def test_no_pickle_based_loading_in_the_library():
    for path in CORE:
        text = path.read_text()
        assert "pickle" not in _imports(path), path
        assert "torch.load(" not in text, f"{path}: use safetensors, never torch.load"


def test_importing_the_package_has_no_side_effects():
    code = (
        "import logging, os; before = dict(os.environ); import ddiloco.cli.main, ddiloco.learner.loop, ddiloco.syncer.loop; "
        "assert dict(os.environ) == before; assert not logging.getLogger().handlers"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_library_logs_instead_of_printing():
    for path in CORE:
        if "cli" in path.parts or path.stem == "cli":  # front ends print
            continue
        lines = path.read_text().splitlines()
        assert not any(line.lstrip().startswith("print(") for line in lines), (
            f"{path}: use logging, not print"
        )


def test_no_import_cycles_counting_imports_inside_functions():
    """A cycle hidden by a function-level import is still a cycle: `python tests/import_graph.py --cycles`."""
    found = describe_cycles(ROOT)
    assert not found, "import cycles (move what both sides need into a third module):\n" + "\n".join(found)


def test_every_module_is_in_a_wing_and_no_import_runs_back_up():
    """The wings (tests/import_graph.py `WINGS`, lowest first): a module imports its own wing or lower ones."""
    for module in library_modules(ROOT):
        wing_of(module)  # names the module in its error when it is in no wing
    up = arrows_up(ROOT)
    assert not up, "imports of a higher (or sibling) wing; move the shared part down:\n" + "\n".join(up)


def test_the_package_root_stays_small():
    """The root of `ddiloco/` holds at most 12 modules; everything else lives in its wing."""
    root_modules = [p.name for p in (ROOT / "ddiloco").glob("*.py")]
    assert len(root_modules) <= 12, sorted(root_modules)


def test_library_files_stay_under_500_lines():
    long = {_rel(p): n for p in LIBRARY if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"split by responsibility, at most {MAX_FILE_LINES} lines per file: {long}"


def test_classes_stay_under_300_lines():
    long = {}
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                long[f"{_rel(path)}:{node.lineno} {node.name}"] = n
    assert not long, f"give each class one responsibility, at most {MAX_CLASS_LINES} lines: {long}"


def test_no_fmt_skip_packing_in_the_library():
    marked = [
        f"{_rel(p)}:{i}"
        for p in LIBRARY
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "fmt: skip" in line
    ]
    assert not marked, f"delete the marker and let `ruff format` lay the code out: {marked}"


def _is_version_assignment(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def test_package_init_files_hold_only_a_docstring():
    """Import from the submodule (`from ddiloco.learner.loop import Learner`), never through a package.
    `ddiloco/__init__.py` may also set `__version__` (components/images.py reads it from the file)."""
    offenders = []
    for path in LIBRARY:
        if path.name != "__init__.py":
            continue
        body = ast.parse(path.read_text()).body
        if path == ROOT / "ddiloco" / "__init__.py":  # the distribution's version lives beside its docstring
            body = [n for n in body if not _is_version_assignment(n)]
        docstring_only = len(body) <= 1 and all(
            isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
            for n in body
        )
        if not docstring_only:
            offenders.append(_rel(path))
    assert not offenders, f"package __init__ files must hold only a docstring: {offenders}"
