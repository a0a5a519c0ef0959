"""The import graph of the `ddiloco` library, read from the source (nothing is imported).

    python tests/import_graph.py            # every module and the ddiloco modules it imports
    python tests/import_graph.py --cycles   # only the import cycles, with the lines that close them
    python tests/import_graph.py --wings    # the wings, lowest first, their counts and any arrow back up

Exit status 1 when there is a cycle or an arrow back up. tests/unit/test_house_rules.py runs the same checks.

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
- The library is built in wings (`WINGS`, lowest first): a module may import its own wing and the wings below
  it. Wings in one tier are siblings and do not import each other.
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


WINGS: tuple[tuple[str, ...], ...] = (
    ("ddiloco", "ddiloco.errors", "ddiloco.keys", "ddiloco.stateful"),  # names, keys, errors: no imports
    ("ddiloco.store",),  # the object-store contract and its backends
    ("ddiloco.platform",),  # ports, devices, hosts, memory, failpoints
    ("ddiloco.codec",),  # upload and download codecs, encoded tensors
    ("ddiloco.config",),  # every config section and its checks
    ("ddiloco.protocol",),  # messages, signing, the wire format, validation
    ("ddiloco.model",),  # the GPT and Hugging Face causal LMs
    ("ddiloco.data",),  # corpora, tokenizers, shards, token streams
    ("ddiloco.tracking",),  # metrics, TensorBoard, MLflow, shipped logs, pace
    ("ddiloco.run",),  # the run root, global versions, preparing and joining a run
    ("ddiloco.chaos",),  # faults injected into a run
    ("ddiloco.learner", "ddiloco.syncer"),  # the two roles
    ("ddiloco.posttrain", "ddiloco.simulate"),  # evaluation, SFT, report; the what-if simulator
    ("ddiloco.baseline", "ddiloco.launch"),  # data-parallel baseline; the local orchestrator
    ("ddiloco.components",),  # KFP components
    ("ddiloco.pipelines",),  # KFP pipelines
    ("ddiloco.cli",),  # the `ddiloco` command
)
"""The wings, lowest first; each entry a module or package (with everything under it)."""


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


def wing_of(module: str) -> str:
    """The wing a module belongs to: the longest `WINGS` entry it is or lives under."""
    names = [
        w for tier in WINGS for w in tier if module == w or (w != "ddiloco" and module.startswith(w + "."))
    ]
    if not names:
        raise KeyError(f"{module} is in no wing: add it to WINGS in tests/import_graph.py")
    return max(names, key=len)


def tier_of(wing: str) -> int:
    return next(i for i, tier in enumerate(WINGS) if wing in tier)


def arrows_up(root: Path = ROOT) -> list[str]:
    """Every import of a wing above (or beside) the importer's own, with its line."""
    modules = library_modules(root)
    out = []
    for e in import_edges(root):
        a, b = wing_of(e.source), wing_of(e.target)
        if a != b and tier_of(b) >= tier_of(a):
            where = modules[e.source].relative_to(root)
            out.append(f"{e.source} ({a}) -> {e.target} ({b})  ({where}:{e.line})")
    return out


def describe_wings(root: Path = ROOT) -> list[str]:
    """Each wing, lowest first, with its module count and the wings it imports; then the counts."""
    modules = library_modules(root)
    graph = import_graph(root)
    out = []
    for i, tier in enumerate(WINGS):
        for wing in tier:
            members = [m for m in modules if wing_of(m) == wing]
            uses = sorted({wing_of(t) for m in members for t in graph[m]} - {wing})
            out.append(f"{i:2} {wing:22} {len(members):3} modules  imports: {', '.join(uses) or '-'}")
    root_modules = [m for m in modules if m.count(".") == 1 and not (root / "ddiloco" / m[8:]).is_dir()]
    root_modules = [m for m in root_modules if m.split(".")[1] not in ("components", "pipelines")]
    out.append(f"root modules: {len(root_modules)} ({', '.join(sorted(m[8:] for m in root_modules))})")
    out.append(f"arrows back up: {len(arrows_up(root))}; import cycles: {len(cycles(graph))}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", action="store_true", help="print only the import cycles")
    parser.add_argument("--wings", action="store_true", help="print the wings and any arrow back up")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    found = describe_cycles(args.root)
    up = arrows_up(args.root)
    if args.wings:
        print("\n".join(describe_wings(args.root) + up))
    elif args.cycles:
        print("\n".join(found) if found else "no import cycles")
    else:
        for module, targets in sorted(import_graph(args.root).items()):
            print(f"{module} -> {', '.join(sorted(targets))}")
    return 1 if found or up else 0


if __name__ == "__main__":
    sys.exit(main())
