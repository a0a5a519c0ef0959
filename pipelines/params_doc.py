"""The run-time parameter tables of docs/cluster.md, rendered from the parameters' table
(`ddiloco.components.params`: the descriptions the KFP UI shows, the defaults) between `<!-- params:NAME -->`
markers.

`python -m ddiloco.pipelines.params_doc [DOC]` rewrites them in place (default: the repository's
docs/cluster.md); `tests/pipelines/test_descriptions.py` fails when the docs hold anything else.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from ddiloco.components import params
from ddiloco.pipelines import join, smoke
from ddiloco.pipelines.pretrain import ClusterOptions, run_defaults

TABLES = ("pretrain", "join")
"""The tables in the docs: pretrain's (with smoke's defaults where they differ) and join's."""
DOC = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"


def _value(value: Any) -> str:
    if value == "":
        return "empty"
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def render(name: str) -> str:
    """The Markdown table of pipeline `name`'s run-time parameters: name, meaning, default."""
    if name == "join":
        table, defaults, others = params.JOIN, run_defaults(params.JOIN, join.OPTIONS), {}
    else:
        table = params.PRETRAIN
        defaults, others = run_defaults(table, ClusterOptions()), run_defaults(table, smoke.OPTIONS)
    rows = ["| parameter | meaning | default |", "|---|---|---|"]
    for param in table:
        default = _value(defaults[param.name])
        if param.name in others and others[param.name] != defaults[param.name]:
            default += f" (smoke: {_value(others[param.name])})"
        rows.append(f"| `{param.name}` | {param.description.replace('|', '/')} | {default} |")
    return "\n".join(rows)


def _markers(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- params:{name} -->\n)(.*?)(<!-- /params:{name} -->)", re.S)


def current(text: str, name: str) -> str:
    """The table between the markers of `name` in `text` (a ValueError when the markers are missing)."""
    m = _markers(name).search(text)
    if m is None:
        raise ValueError(f"no <!-- params:{name} --> ... <!-- /params:{name} --> markers")
    return m[2].rstrip("\n")


def rendered(text: str) -> str:
    """`text` with every table between its markers rendered anew."""
    for name in TABLES:
        current(text, name)
        text = _markers(name).sub(lambda m, n=name: f"{m[1]}{render(n)}\n{m[3]}", text)
    return text


if __name__ == "__main__":
    doc = Path(sys.argv[1]) if len(sys.argv) > 1 else DOC
    doc.write_text(rendered(doc.read_text()))
