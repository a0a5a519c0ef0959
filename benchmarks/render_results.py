"""Render the README's headline figures and docs/results.md's current-figures table from docs/results/*.json.

    .venv/bin/python benchmarks/render_results.py          # rewrite both blocks
    .venv/bin/python benchmarks/render_results.py --check  # exit 1 when the committed text differs

Each claim file (written by a benchmark's `--record CLAIM`, `benchmarks/_record.py`, or by hand for a figure
measured before benchmarks recorded) holds the command, commit, date, machine and figures; `headline` is the
README bullet, a `str.format` template over `figures`; `figure` the table's short form. A claim whose
`older_code` is true was measured on code that has changed since: both renderings say so, with its commit.
The blocks sit between `<!-- results:begin -->` and `<!-- results:end -->` in README.md and docs/results.md;
`tests/unit/test_results_render.py` fails when the committed text is not what this renders.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
REQUIRED = ("claim", "title", "order", "section", "headline", "figure", "command", "commit", "measured_at",
            "machine", "figures")  # fmt: skip


def claims(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every claim file, checked for the keys the renderer reads, in headline order."""
    out = []
    for path in sorted(folder.glob("*.json")):
        doc = json.loads(path.read_text())
        missing = [k for k in REQUIRED if k not in doc]
        if missing or not {"cpus", "cpu", "loadavg"} <= set(doc["machine"]):
            raise ValueError(f"{path}: missing {missing or 'machine.cpus/cpu/loadavg'}")
        out.append(doc)
    return sorted(out, key=lambda d: d["order"])


def fill(doc: dict[str, Any], template: str) -> str:
    """`template` with the claim's figures; one naming a figure the file lacks (a re-recorded claim whose
    benchmark reports others) is a ValueError that names the claim and the figure."""
    try:
        return template.format(**doc["figures"])
    except KeyError as e:
        raise ValueError(f"claim {doc['claim']}: its text names {e}, which its figures lack") from None


def provenance(doc: dict[str, Any]) -> str:
    where = f"measured {doc['measured_at']} at {doc['commit']}"
    return where + (", on older code" if doc.get("older_code") else "")


def readme_block(docs: list[dict[str, Any]]) -> str:
    lines = []
    for d in docs:
        text = fill(d, d["headline"])
        lines.append(f"- **{d['title']}** {text} ([{provenance(d)}]({d['section']})).")
    return "\n".join(lines)


def table_block(docs: list[dict[str, Any]]) -> str:
    rows = ["| claim | figure | measured | command |", "|---|---|---|---|"]
    for d in docs:
        section = d["section"].removeprefix("docs/results.md").removeprefix("docs/")  # links from docs/
        figure = fill(d, d["figure"])
        cmd = d["command"].replace("|", "\\|")
        rows.append(f"| [{d['title'].rstrip('.')}]({section}) | {figure} | {provenance(d)} | `{cmd}` |")
    return "\n".join(rows)


def splice(text: str, block: str, where: str) -> str:
    """`text` with what lies between the markers replaced by `block`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{where}: needs exactly one {BEGIN} and one {END}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def rendered(root: Path = ROOT) -> dict[Path, str]:
    """What README.md and docs/results.md should hold."""
    docs = claims(root / "docs" / "results")
    readme, results = root / "README.md", root / "docs" / "results.md"
    return {
        readme: splice(readme.read_text(), readme_block(docs), "README.md"),
        results: splice(results.read_text(), table_block(docs), "docs/results.md"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed text differs")
    args = ap.parse_args(argv)
    stale = []
    for path, text in rendered().items():
        if path.read_text() != text:
            stale.append(path.relative_to(ROOT).as_posix())
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        sys.stderr.write(f"stale: {', '.join(stale)}; run benchmarks/render_results.py\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
