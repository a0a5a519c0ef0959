"""The Python documentation that ships inside every CPython install, as (id, text) documents; no download.

Two sources, both in the standard library: `pydoc_data.topics.topics` (the prose `help("assert")` shows),
one document per topic with id `topic/<name>`, and the docstrings of every public standard-library module
and its public classes, functions and methods, one document per module with id `module/<name>`.

This file imports only the standard library and runs as a script in a fresh, isolated interpreter
(`python -I`, started by `ddiloco.data.corpora`), so what it collects does not depend on what the caller
imported, and the import side effects of ~530 modules stay in a process that exits. It writes one JSON
object to stdout. Modules with side effects or GUI toolkits are never imported; modules that fail to import
are listed in `failed`. The output is deterministic for a given interpreter.

Design notes (the modules skipped and why): docs/internals.md, "The Python-documentation corpus".
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import platform
import sys
import warnings
from types import ModuleType
from typing import Any

SKIPPED = frozenset(
    {
        "antigravity",
        "this",
        "idlelib",
        "tkinter",
        "turtle",
        "turtledemo",
        "lib2to3",
        "readline",
        "rlcompleter",
    }
)
"""Top-level modules never imported (side effects, GUI, pickled data); `pydoc_data` is read directly."""
TEST_PACKAGES = frozenset({"test", "tests", "idle_test"})


def topic_documents() -> list[tuple[str, str]]:
    """One (id, text) per `help()` topic, sorted by topic name."""
    from pydoc_data.topics import topics

    return [(f"topic/{name}", topics[name].strip()) for name in sorted(topics) if topics[name].strip()]


def _public(name: str) -> bool:
    return not any(p.startswith("_") or p in TEST_PACKAGES for p in name.split("."))


def _quiet_import(name: str) -> ModuleType:
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def module_names() -> tuple[list[str], list[str]]:
    """(public stdlib modules and submodules that import, sorted; those that failed to import)."""
    top = sorted(n for n in sys.stdlib_module_names if _public(n) and n not in SKIPPED | {"pydoc_data"})
    names: set[str] = set()
    failed: set[str] = set()
    for name in top:
        try:
            module = _quiet_import(name)
        except Exception:  # ImportError, or a platform module that raises something else on import
            failed.add(name)
            continue
        names.add(name)
        if hasattr(module, "__path__"):
            for info in pkgutil.walk_packages(module.__path__, f"{name}.", onerror=lambda _: None):
                if _public(info.name):
                    names.add(info.name)
    ok = []
    for name in sorted(names):
        try:
            _quiet_import(name)
        except Exception:
            failed.add(name)
        else:
            ok.append(name)
    return ok, sorted(failed)


def _member_docs(module: ModuleType) -> list[tuple[str, Any]]:
    """(qualified name, object) for the module's own public classes and functions, and their methods."""
    out: list[tuple[str, Any]] = [(module.__name__, module)]
    for key, obj in sorted(vars(module).items()):
        if key.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        out.append((f"{module.__name__}.{key}", obj))
        if inspect.isclass(obj):
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") and attr != "__init__":
                    continue
                if inspect.isroutine(member) or isinstance(member, property | classmethod | staticmethod):
                    out.append((f"{module.__name__}.{key}.{attr}", member))
    return out


def module_documents(names: list[str]) -> list[tuple[str, str]]:
    """One (id, text) per module with any new docstring: `name\\n\\ndocstring` sections, blank-line separated."""
    seen: set[str] = set()
    docs = []
    for name in names:
        sections = []
        for qualname, obj in _member_docs(_quiet_import(name)):
            raw = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
            if not isinstance(raw, str):
                continue
            text = inspect.cleandoc(raw).strip()
            if text and text not in seen:
                seen.add(text)
                sections.append(f"{qualname}\n\n{text}")
        if sections:
            docs.append((f"module/{name}", "\n\n\n".join(sections)))
    return docs


def collect() -> dict[str, Any]:
    """Every document, plus the interpreter it came from and the modules that did not import."""
    names, failed = module_names()
    docs = topic_documents() + module_documents(names)
    return {
        "documents": [{"id": i, "text": t} for i, t in docs],
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "python_build": " ".join(platform.python_build()),
        "platform": sys.platform,
        "modules": len(names),
        "failed_imports": failed,
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(collect(), ensure_ascii=False))
