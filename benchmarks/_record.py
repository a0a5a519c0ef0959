"""A benchmark's result as data: `--record CLAIM` writes docs/results/CLAIM.json (what the README's headline
figures and the current-figures table of docs/results.md are rendered from, `benchmarks/render_results.py`).

The file names the command line, the commit (and whether the tree had changes), the machine (cores, CPU
model, load average) and the date, beside the figures the claim's headline reads and the benchmark's whole
output. A claim file keeps the texts the renderer reads (`headline`, `figure`, `order`, `section`, `title`)
from the file it replaces; when they name figures the benchmark does not report, the render says which.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

from ddiloco.cli.version import commit as checkout_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
KEPT = ("headline", "order", "section", "title", "figure")
"""What the renderer reads that a measurement does not make: kept from the claim file it replaces."""


def this_machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "loadavg": [round(x, 2) for x in os.getloadavg()]}


def command_line() -> str:
    """This process's command line, as a user would type it from the checkout's root."""
    return shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])


def record(
    claim: str,
    figures: dict[str, Any],
    output: Any = None,
    *,
    folder: Path = RESULTS,
    command: str | None = None,
    commit: str | None = None,
    machine: dict[str, Any] | None = None,
) -> Path:
    """Write docs/results/CLAIM.json for this run (module docstring); returns its path. `command`, `commit`
    and `machine` default to this process's; a claim made from earlier runs' results passes theirs."""
    path = folder / f"{claim}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    doc = {k: old[k] for k in KEPT if k in old}
    doc |= {
        "claim": claim,
        "command": command or command_line(),
        "commit": commit or checkout_commit(ROOT),
        "measured_at": dt.date.today().isoformat(),
        "machine": machine or this_machine(),
        "figures": figures,
    }
    if output is not None:
        doc["output"] = output
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True, default=str) + "\n")
    return path
