"""Throughput and memory of `ddiloco tokenize` (`ddiloco.data.textcorpus`) on a synthetic JSON lines corpus.

Writes ``--mb`` MB of generated documents (a few thousand made-up words, Zipf-distributed, documents of
20-2000 words) as ``--files`` .jsonl files in a temp directory, then tokenizes them with the byte
tokenizer at each ``--workers`` count (a fresh output store each, so nothing is reused), runs the last
count again on the same output (it must reuse: ``reused``), and does the same for a byte-level BPE
tokenizer (``--bpe-vocab`` ids) trained on a 2 MB sample, over the first ``--bpe-mb`` MB of files, at
least one file per worker (BPE is an order of magnitude slower). ``TOKENIZERS_PARALLELISM=false``: each
worker encodes on one thread, so the speed-up is that of the worker processes. Peak RSS is each worker's own high-water mark, read
inside the worker (VmHWM of /proc/self/status, recorded in its unit records: getrusage's ru_maxrss of a
spawned process still carries its parent's mark); a 1-worker run tokenizes in this process. Temp files are
deleted. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/tokenize_corpus.py --mb 200 --workers 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # before tokenizers is imported (workers inherit)

import numpy as np  # noqa: E402

from ddiloco.data.textcorpus.corpus import tokenize_to_npy  # noqa: E402
from ddiloco.data.tokenizer import ByteTokenizer, Tokenizer, train_bpe  # noqa: E402
from ddiloco.store.file import FileStore  # noqa: E402

SYLLABLES = "ka lo mi ne ru sa te vo zi pa qu ex an in or ul ba de fi go".split()


def write_corpus(root: Path, mb: int, files: int, seed: int = 0) -> int:
    """`files` .jsonl files of about mb MB in all, written a chunk at a time; returns the bytes written."""
    rng = np.random.default_rng(seed)
    words = np.array(
        ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 5))) for _ in range(5000)], dtype=object
    )
    weights = 1.0 / np.arange(1, len(words) + 1)
    weights /= weights.sum()
    per_file = mb * 1_000_000 // files
    total = 0
    for i in range(files):
        with open(root / f"part-{i:03d}.jsonl", "w", encoding="utf-8") as f:
            written = 0
            while written < per_file:
                lines = []
                for n in rng.integers(20, 2000, size=64):
                    text = " ".join(words[rng.choice(len(words), size=n, p=weights)])
                    lines.append(json.dumps({"text": text.capitalize() + ".", "id": total + written}) + "\n")
                chunk = "".join(lines)
                f.write(chunk)
                written += len(chunk)
        total += written
    return total


def timed_runs(src: Path, out_root: Path, tag: str, tok: Tokenizer, workers: list[int]) -> dict:
    runs = {}
    for w in workers:
        store = FileStore(out_root / f"{tag}-w{w}")
        runs[w] = tokenize_to_npy(str(src), store, "", tok, workers=w).summary()
    again = tokenize_to_npy(
        str(src), FileStore(out_root / f"{tag}-w{workers[-1]}"), "", tok, workers=workers[-1]
    )
    base = runs[workers[0]]
    out = {
        "documents": base["documents"],
        "tokens": base["tokens"],
        "mb_in": round(base["bytes_in"] / 1e6, 1),
        "reused": again.reused,
        "reuse_seconds": round(again.seconds, 2),
    }
    for w, s in runs.items():
        out[f"w{w}"] = {
            k: s[k]
            for k in (
                "seconds",
                "hash_seconds",
                "documents_per_s",
                "mb_per_s_per_worker",
                "peak_rss_mb_per_worker",
            )
        }
    if len(workers) > 1:
        out[f"speedup_w{workers[-1]}"] = round(base["seconds"] / runs[workers[-1]]["seconds"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="corpus size in MB")
    ap.add_argument("--files", type=int, default=8, help="number of .jsonl files")
    ap.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    ap.add_argument("--bpe-mb", type=int, default=25, help="MB of the corpus the BPE runs read (0: no BPE)")
    ap.add_argument("--bpe-vocab", type=int, default=4096)
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="ddiloco-tokbench-"))
    try:
        src = tmp / "corpus"
        src.mkdir()
        t0 = time.monotonic()
        written = write_corpus(src, args.mb, args.files)
        result: dict = {"corpus_mb": round(written / 1e6, 1), "files": args.files, "generate_s": 0.0}
        result["generate_s"] = round(time.monotonic() - t0, 1)
        result["byte"] = timed_runs(src, tmp / "out", "byte", ByteTokenizer(), workers)
        if args.bpe_mb:
            files = sorted(src.glob("*.jsonl"))
            sample = files[0].read_text(encoding="utf-8")[:2_000_000].splitlines()
            bpe = train_bpe((json.loads(line)["text"] for line in sample[:-1]), args.bpe_vocab)
            sub = tmp / "bpe-corpus"
            sub.mkdir()
            take = max(max(workers), round(len(files) * args.bpe_mb / args.mb))  # a file per worker at least
            for f in files[:take]:
                os.link(f, sub / f.name)
            result["bpe"] = {"vocab": bpe.vocab_size, **timed_runs(sub, tmp / "out", "bpe", bpe, workers)}
        print(json.dumps(result))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
