"""Every third-party package the library imports is declared in pyproject.toml (the base dependencies or
an extra), read from the source (ast, nothing imported) so that an import of an extra's package counts
too. Import names are mapped to distribution names where they differ."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("ddiloco", "components", "pipelines")
# import name -> distribution name, where they differ
DISTRIBUTION = {
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "lm_eval": "lm-eval",
    "mlflow": "mlflow-skinny",
}
# no upper bound: a CA bundle is only ever better newer
UNBOUNDED = {"certifi"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def third_party_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Top-level imported names outside the standard library and the package -> the files importing them."""
    found: dict[str, set[str]] = defaultdict(set)
    for folder in LIBRARY:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for top in {name.split(".")[0] for name in names}:
                    if top not in sys.stdlib_module_names and top not in LIBRARY:
                        found[top].add(str(path.relative_to(root)))
    return found


def declared(pyproject: dict) -> set[str]:
    """The distributions named in `dependencies` and every extra (self-references excluded)."""
    project = pyproject["project"]
    requirements = [
        *project["dependencies"],
        *(r for extra in project["optional-dependencies"].values() for r in extra),
    ]
    names = {normalize(re.match(r"[A-Za-z0-9._-]+", r)[0]) for r in requirements}
    return names - {project["name"]}


def test_every_third_party_import_is_a_declared_dependency():
    names = declared(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    imports = third_party_imports()
    assert {"torch", "yaml", "urllib3", "certifi", "zstandard", "kfp"} <= set(imports)  # the walk finds them
    missing = {
        name: sorted(files)
        for name, files in imports.items()
        if normalize(DISTRIBUTION.get(name, name)) not in names
    }
    assert not missing, f"imported but not declared in pyproject.toml (dependencies or an extra): {missing}"


def test_base_dependencies_are_ranges_and_the_dev_extra_pins_them():
    """Ranges where ddiloco is installed next to other packages; the exact versions CI tests with in `dev`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {normalize(r.split("==")[0]) for r in project["optional-dependencies"]["dev"] if "==" in r}
    for requirement in project["dependencies"]:
        name = normalize(re.match(r"[A-Za-z0-9._-]+", requirement)[0])
        assert "==" not in requirement and ("<" in requirement or name in UNBOUNDED), requirement
        assert name in pinned, f"{requirement}: pin the version CI tests with in the dev extra"
