"""`ddiloco tokenize --input PATH_OR_URL --out URL`: text files -> content-addressed `.npy` token parts.

Design choices:
- A thin front end over `ddiloco.data.textcorpus.corpus.tokenize_to_npy` and `ddiloco.data.textcorpus.choose`; the
  output is a prefix `corpus-{key}` under `--out`, reused when the same data and tokenizer come again.
- `--stage plan|unit|finish` runs one stage of `tokenize_to_npy` (the pipeline's tokenize steps: a plan,
  a ParallelFor over the units, a finish); all state is in the store, so each stage is its own process.
- Like the other commands that report a result: one line for people on stderr (where the tokens are and
  whether they were reused), the summary as one JSON line on stdout (its "url" is the prefix).
"""

from __future__ import annotations

import argparse
from typing import Any

from ddiloco.cli.args import emit


def cmd_tokenize(args: argparse.Namespace) -> int:
    from ddiloco.data.textcorpus.choose import tokenizer_from_spec
    from ddiloco.data.textcorpus.corpus import plan_corpus, tokenize_to_npy
    from ddiloco.store.url import open_store

    if args.stage in ("unit", "finish"):
        return _stage(args)
    if not args.input or not args.out:
        raise ValueError(f"--stage {args.stage} needs --input and --out")
    tokenizer = tokenizer_from_spec(args.tokenizer, args.model_hf)
    if args.stage == "plan":
        plan = plan_corpus(
            args.input, open_store(args.out), "", tokenizer, shard_tokens=args.shard_tokens, field=args.field
        )
        return emit({k: plan[k] for k in ("url", "reused", "units")})
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
    return emit(
        s,
        f"{how} {s['tokens']:,} {s['dtype']} tokens of {s['documents']:,} documents in {s['parts']} parts at "
        f"{result.url}",
    )


def _stage(args: argparse.Namespace) -> int:
    """`--stage unit|finish --corpus URL`: one planned unit, or the manifest once all are done."""
    from ddiloco.data.textcorpus.corpus import finish_corpus, run_planned_unit
    from ddiloco.store.url import open_store

    if not args.corpus or "/corpus-" not in args.corpus:
        raise ValueError(f"--stage {args.stage} needs --corpus URL/corpus-KEY (the URL --stage plan printed)")
    base, prefix = args.corpus.rstrip("/").rsplit("/", 1)
    store = open_store(base)
    if args.stage == "unit":
        if args.unit is None:
            raise ValueError("--stage unit needs --unit N (one of the units --stage plan printed)")
        record = run_planned_unit(store, prefix, args.unit)
        return emit({k: v for k, v in record.items() if k != "parts"})
    manifest = finish_corpus(store, prefix)
    return emit(
        {"url": args.corpus.rstrip("/"), "tokens": manifest["tokens"], "parts": len(manifest["parts"])}
    )


def register(sub: Any) -> None:
    """Add `tokenize` to the `ddiloco` subcommands."""
    from ddiloco.data.textcorpus.corpus import DEFAULT_SHARD_TOKENS

    p = sub.add_parser(
        "tokenize", help="tokenize text files (txt, jsonl, parquet, datasets) into .npy token parts"
    )
    p.add_argument("--input", help="a file, a directory or a store prefix URL (file://, s3://) of text files")
    p.add_argument("--out", help="store URL (or path) the corpus-KEY prefix is written under")
    p.add_argument(
        "--stage",
        choices=("all", "plan", "unit", "finish"),
        default="all",
        help="all (default); or one stage, as the pipeline runs them: plan (prints the corpus URL and its "
        "units), unit (--corpus URL --unit N: one input file), finish (--corpus URL: the manifest)",
    )
    p.add_argument("--corpus", help="with --stage unit|finish: the corpus URL --stage plan printed")
    p.add_argument("--unit", type=int, help="with --stage unit: which input file")
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
