"""`ddiloco tokenize --input PATH_OR_URL --out URL`: text files -> content-addressed `.npy` token parts.

Design choices:
- A thin front end over `ddiloco.textcorpus.corpus.tokenize_to_npy` and `ddiloco.textcorpus.choose`; the
  output is a prefix `corpus-{key}` under `--out`, reused when the same data and tokenizer come again.
- Like the other commands that report a result: one line for people on stderr (where the tokens are and
  whether they were reused), the summary as one JSON line on stdout (its "url" is the prefix).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def cmd_tokenize(args: argparse.Namespace) -> int:
    from ddiloco.store.url import open_store
    from ddiloco.textcorpus.choose import tokenizer_from_spec
    from ddiloco.textcorpus.corpus import tokenize_to_npy

    tokenizer = tokenizer_from_spec(args.tokenizer, args.model_hf)
    result = tokenize_to_npy(
        args.input,
        open_store(args.out),
        "",
        tokenizer,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        field=args.field,
    )
    s = result.summary()
    how = "reused" if result.reused else "wrote"
    print(
        f"{how} {s['tokens']:,} {s['dtype']} tokens of {s['documents']:,} documents in {s['parts']} parts at "
        f"{result.url}",
        file=sys.stderr,
    )
    print(json.dumps(s, sort_keys=True))
    return 0


def register(sub: Any) -> None:
    """Add `tokenize` to the `ddiloco` subcommands."""
    from ddiloco.textcorpus.corpus import DEFAULT_SHARD_TOKENS

    p = sub.add_parser(
        "tokenize", help="tokenize text files (txt, jsonl, parquet, datasets) into .npy token parts"
    )
    p.add_argument(
        "--input",
        required=True,
        help="a file, a directory or a store prefix URL (file://, s3://) of text files",
    )
    p.add_argument("--out", required=True, help="store URL (or path) the corpus-KEY prefix is written under")
    p.add_argument(
        "--tokenizer",
        default="auto",
        help="byte, model (needs --model-hf), auto (model if --model-hf has one, else byte), or a PATH to a "
        "tokenizer.json or model directory (default %(default)s)",
    )
    p.add_argument("--model-hf", metavar="DIR", help="model directory whose tokenizer to use")
    p.add_argument("--workers", type=int, default=1, help="worker processes (default %(default)s)")
    p.add_argument("--field", default="text", help="JSON lines field / Parquet column of the text")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help="tokens per .npy part (default %(default)s)",
    )
    p.set_defaults(func=cmd_tokenize)
