"""`ddiloco corpus python-docs --out PATH`: write a real-text corpus that needs no download (`ddiloco.data.corpora`).

Design choices:
- One subcommand per corpus, so a later corpus adds a name, not a flag; the file is what `data.source`
  takes (`--set data.source=PATH`), and the sidecar next to it names the text exactly.
- The command prints where it wrote, the size and the checksum on stderr, and the sidecar as one JSON line
  on stdout (like the other commands that report a result).
"""

from __future__ import annotations

import argparse
from typing import Any

from ddiloco.cli.args import emit
from ddiloco.data.corpora import sidecar_path, write_python_docs


def cmd_python_docs(args: argparse.Namespace) -> int:
    meta = write_python_docs(args.out)
    return emit(
        meta,
        f"wrote {args.out}: {meta['documents']} documents ({meta['topics']} help() topics, "
        f"{meta['module_documents']} modules' docstrings), {meta['characters']:,} characters, "
        f"{meta['bytes']:,} bytes, Python {meta['python']}, sha256 {meta['sha256']}; "
        f"metadata in {sidecar_path(args.out)}; train on it with --set data.source={args.out}",
    )


def register(sub: Any) -> None:
    """Add `corpus` to the `ddiloco` subcommands."""
    p = sub.add_parser("corpus", help="write a real-text corpus that installs offline (no download)")
    names = p.add_subparsers(dest="corpus", required=True)
    docs = names.add_parser(
        "python-docs",
        help="the Python documentation shipped with this interpreter: help() topics and stdlib docstrings",
    )
    docs.add_argument(
        "--out", default="python-docs.jsonl", help="corpus file to write, *.jsonl (default %(default)s)"
    )
    docs.set_defaults(func=cmd_python_docs)
