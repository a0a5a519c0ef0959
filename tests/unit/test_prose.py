"""Prose rules (issue 53): short module docstrings, no notes about the past, no references to missing documents.

A module docstring says what the module does and why in at most 15 lines; the longer reasoning goes to
docs/internals.md (or the doc of its topic). Code says what it does now, never "as before". Every document a
file names (`docs/<name>.md`, `<NAME>.md`, a Markdown link to a `.md` file) exists in the repository.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = sorted(
    p for folder in ("ddiloco", "components", "pipelines") for p in (ROOT / folder).rglob("*.py")
)
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
MAX_DOCSTRING_LINES = 15

AS_BEFORE = re.compile(r"\bas\s+(?:#\s*)?before\b", re.IGNORECASE)
# `docs/x.md` or `NAME.md` as a repository path: not the tail of a URL or of another repository's path.
DOC_PATH = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md|[A-Z][A-Z0-9_]*\.md)\b")
# Documents the repository never had, named without `.md`.
NAMED_DOC = re.compile(r"\b(DESIGN|STYLE)\b")
MD_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def docstring_lines(path: Path) -> int:
    """Source lines of the module docstring (quotes included); 0 without one."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            return body[0].end_lineno - body[0].lineno + 1
    return 0


def missing_docs(path: Path) -> list[str]:
    """The documents `path` names that the repository does not hold, in order of appearance."""
    text = path.read_text()
    missing = []
    for m in DOC_PATH.finditer(text):
        name = m.group(1)
        if not ((ROOT / name).is_file() or (path.parent / name).is_file()):
            missing.append(name)
    missing += [m.group(1) for m in NAMED_DOC.finditer(text)]
    if path.suffix == ".md":
        for m in MD_LINK.finditer(text):
            target = m.group(1)
            if "://" not in target and not (path.parent / target).is_file():
                missing.append(target)
    return missing


def measure() -> dict[str, dict]:
    found: dict[str, dict] = {}
    for path in LIBRARY:
        rules = {}
        if (n := docstring_lines(path)) > MAX_DOCSTRING_LINES:
            rules["docstring_lines"] = n
        if n_before := len(AS_BEFORE.findall(path.read_text())):
            rules["as_before"] = n_before
        if missing := missing_docs(path):
            rules["missing_docs"] = missing
        if rules:
            found[_rel(path)] = rules
    for path in DOCS:
        if missing := missing_docs(path):
            found[_rel(path)] = {"missing_docs": missing}
    return found


def test_prose_rules_hold():
    broken = measure()
    assert not broken, (
        f"module docstrings at most {MAX_DOCSTRING_LINES} lines (the reasoning goes to docs/internals.md), "
        f"no 'as before' (say what the code does now), only documents that exist: {broken}"
    )
