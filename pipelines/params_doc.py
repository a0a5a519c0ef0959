"""The run-time parameter tables of docs/cluster.md, rendered from the descriptions the KFP UI shows
(`ddiloco.components.descriptions`) and the pipelines' defaults, between `<!-- params:NAME -->` markers.

`tests/pipelines/test_descriptions.py` checks that the docs hold what this renders (UPDATE_GOLDEN=1 rewrites).
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from ddiloco.components.descriptions import describe
from ddiloco.pipelines import join, smoke
from ddiloco.pipelines.pretrain import DEFAULTS, ClusterOptions, pipeline_function, run_defaults

TABLES = ("pretrain", "join")
"""The tables in the docs: pretrain's (with smoke's defaults where they differ) and join's."""


def _value(value: Any) -> str:
    if value == "":
        return "empty"
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def _signature(name: str) -> list[str]:
    func = join.pipeline_function() if name == "join" else pipeline_function()
    return list(inspect.signature(func.pipeline_func).parameters)


def render(name: str) -> str:
    """The Markdown table of pipeline `name`'s run-time parameters: name, meaning, default."""
    if name == "join":
        defaults, others = run_defaults(DEFAULTS, join.OPTIONS), {}
    else:
        defaults, others = run_defaults(DEFAULTS, ClusterOptions()), run_defaults(DEFAULTS, smoke.OPTIONS)
    rows = ["| parameter | meaning | default |", "|---|---|---|"]
    for param in _signature(name):
        default = _value(defaults[param])
        if param in others and others[param] != defaults[param]:
            default += f" (smoke: {_value(others[param])})"
        rows.append(f"| `{param}` | {describe(name, param).replace('|', '/')} | {default} |")
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
