"""Real-text corpora that install offline: written to a .jsonl file `data.source` reads, with a sidecar.

`python-docs`: the Python documentation inside the interpreter that runs this (`ddiloco.data.pydocs`: the `help()`
topics and the standard library's docstrings; ~1.9M characters on CPython 3.11). Nobody in this project
wrote it and nothing is downloaded: it is the text shipped with CPython, under the PSF License (the
documentation also under the Zero-Clause BSD licence). The documents come from a fresh `python -I`
interpreter as JSON, are written one per line in the order of the SHA-256 of their id (so learner shards and
the validation split are alike), through a temporary file and a rename; `<file>.meta.json` records the
interpreter, the file's SHA-256, its size and the modules that did not import.

Design notes: docs/internals.md, "The Python-documentation corpus".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddiloco.data import pydocs

log = logging.getLogger(__name__)

CORPORA = ("python-docs",)
LICENSE = "text shipped with CPython: PSF License (documentation also Zero-Clause BSD)"
COLLECT_TIMEOUT_S = 300.0


def sidecar_path(path: str | Path) -> Path:
    """Where the metadata of corpus file `path` lives: `<path>.meta.json`."""
    return Path(f"{path}.meta.json")


def python_docs_documents(timeout: float = COLLECT_TIMEOUT_S) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """(documents in corpus order, what the collector reported about the interpreter)."""
    proc = subprocess.run(
        [sys.executable, "-I", "-W", "ignore", pydocs.__file__],
        capture_output=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        tail = proc.stderr.decode("utf-8", "replace")[-2000:]
        raise RuntimeError(f"collecting the Python documentation failed (exit {proc.returncode}): {tail}")
    found = json.loads(proc.stdout.decode("utf-8"))
    docs = sorted(found.pop("documents"), key=lambda d: hashlib.sha256(d["id"].encode()).hexdigest())
    return docs, found


def write_python_docs(out: str | Path) -> dict[str, Any]:
    """Write the `python-docs` corpus to `out` (.jsonl) and its sidecar; returns the sidecar's content."""
    out = Path(out)
    if out.suffix != ".jsonl":
        raise ValueError(f"{out}: the corpus is written as JSON lines; name the file *.jsonl")
    docs, info = python_docs_documents()
    data = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode("utf-8")
    meta = {
        "corpus": "python-docs",
        "file": out.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "documents": len(docs),
        "topics": sum(d["id"].startswith("topic/") for d in docs),
        "module_documents": sum(d["id"].startswith("module/") for d in docs),
        "characters": sum(len(d["text"]) for d in docs),
        "text_utf8_bytes": sum(len(d["text"].encode("utf-8")) for d in docs),
        "license": LICENSE,
        "built_by": "ddiloco corpus python-docs",
        **info,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(out, data)
    _atomic_write(sidecar_path(out), (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
    log.info(
        "wrote %s: %d documents, %d characters (Python %s, sha256 %s)",
        out,
        meta["documents"],
        meta["characters"],
        meta["python"],
        meta["sha256"][:12],
    )
    return meta


def read_meta(path: str | Path) -> dict[str, Any] | None:
    """The sidecar of corpus file `path`, or None when it has none."""
    side = sidecar_path(path)
    return json.loads(side.read_text()) if side.is_file() else None


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
