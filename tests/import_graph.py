"""The import graph of the `ddiloco` library, read from the source (nothing is imported).

    python tests/import_graph.py            # every module and the ddiloco modules it imports
    python tests/import_graph.py --cycles   # only the import cycles, with the lines that close them

Exit status 1 when there is a cycle. tests/unit/test_house_rules.py runs the same check.

Design choices:
- Every import statement counts wherever it stands: at the top, inside a function, under `if TYPE_CHECKING`.
  An import moved into a function to dodge a cycle still ties the two modules together (each needs the
  other to work), so the cycle is reported; break it by moving what both need into a third module.
- Modules are named as installed: `components/` is `ddiloco.components`, `pipelines/` is `ddiloco.pipelines`
  (pyproject's package-dir), so `from ddiloco.components import roles` resolves to `components/roles.py`.
- An edge goes to the module an import names: `from ddiloco.store import Store` depends on the package
  `ddiloco.store` (its `__init__.py`), `from ddiloco import keys` on `ddiloco.keys`. The implicit import of
  parent packages is not an edge; every submodule would otherwise form a cycle with an `__init__` that imports it.
- Cycles are the strongly connected components of that graph (Tarjan's algorithm, iterative).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"ddiloco": "ddiloco", "ddiloco.components": "components", "ddiloco.pipelines": "pipelines"}
"""Installed package name -> its folder in the repository."""


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def library_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the library by its installed dotted name."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name an ImportFrom refers to (`from ..x import y` inside `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported_names(module: str, is_package: bool, tree: ast.AST) -> Iterator[tuple[list[str], int]]:
    """For each import statement: the candidate module names, most specific first, and its line."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield [alias.name], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, is_package, node)
            for alias in node.names:
                yield [f"{base}.{alias.name}", base], node.lineno


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The library module `name` is, or lives in (`ddiloco.store.Store` -> `ddiloco.store`); None outside it."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_edges(root: Path = ROOT) -> list[Edge]:
    """Every import of one library module by another (the first line per pair)."""
    modules = library_modules(root)
    edges: dict[tuple[str, str], Edge] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for candidates, line in _imported_names(module, path.name == "__init__.py", tree):
            target = next((t for t in (_resolve(c, modules) for c in candidates) if t), None)
            if target is not None and target != module and (module, target) not in edges:
                edges[module, target] = Edge(module, target, line)
    return sorted(edges.values(), key=lambda e: (e.source, e.target))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the library modules it imports (every module is a key)."""
    graph: dict[str, set[str]] = {m: set() for m in library_modules(root)}
    for edge in import_edges(root):
        graph[edge.source].add(edge.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def describe_cycles(root: Path = ROOT) -> list[str]:
    """One paragraph per cycle: its modules and the import lines inside it (where to cut)."""
    edges = import_edges(root)
    modules = library_modules(root)
    out = []
    for component in cycles(import_graph(root)):
        members = set(component)
        lines = [f"cycle of {len(component)} modules: {', '.join(component)}"]
        for e in edges:
            if e.source in members and e.target in members:
                where = modules[e.source].relative_to(root)
                lines.append(f"  {e.source} -> {e.target}  ({where}:{e.line})")
        out.append("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", action="store_true", help="print only the import cycles")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    found = describe_cycles(args.root)
    if args.cycles:
        print("\n".join(found) if found else "no import cycles")
    else:
        for module, targets in sorted(import_graph(args.root).items()):
            print(f"{module} -> {', '.join(sorted(targets))}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
