"""Throughput of the syncer's merge path for one fragment, against a plain memory copy of the same bytes.

One round = decode each learner's encoded delta (``--codec``), ``merge`` with RDA, one ``OuterNesterov``
step. ``merge_gb_per_s`` = M x fragment fp32 bytes / seconds per round; ``memcpy_gb_per_s`` times
``dst.copy_(src)`` over the same M x fragment bytes in the same process, so ``ratio`` says how close the
merge comes to streaming its inputs once. Two variants are timed: ``fresh`` calls the functions with their
defaults (every round allocates its decoded deltas and merged gradient, paying first-touch page faults),
``reused`` passes ``out=`` buffers kept across rounds, as a syncer that merges the same fragment every P
rounds can. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/merge_throughput.py --learners 8 --fragment-mb 64 --codec int4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddiloco.compression import CODECS, decode, encode, encoded_nbytes
from ddiloco.merge import OuterNesterov, merge, token_weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=8, help="M, answers merged per round")
    ap.add_argument("--fragment-mb", type=float, default=64.0, help="fragment size in MiB of fp32")
    ap.add_argument("--tensors", type=int, default=4, help="tensors in the fragment (RDA runs per tensor)")
    ap.add_argument("--codec", choices=CODECS, default="fp32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    numel = int(args.fragment_mb * 2**20) // 4
    sizes = [numel // args.tensors + (i < numel % args.tensors) for i in range(args.tensors)]
    shapes = {f"layer.{i}.weight": (n,) for i, n in enumerate(sizes)}
    params = {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}
    encoded, encode_s = [], 0.0
    for _ in range(args.learners):
        parts = {}
        for name, shape in shapes.items():
            delta = torch.randn(shape, generator=g) * 1e-3
            t0 = time.perf_counter()
            parts[name] = encode(delta, args.codec)
            encode_s += time.perf_counter() - t0
        encoded.append(parts)
    weights = [token_weight(4096 * (m + 1), 8 + m) for m in range(args.learners)]
    opt = OuterNesterov()
    opt.step(params, {n: torch.zeros(s) for n, s in shapes.items()})  # momentum exists: the steady state

    dec_bufs = [{n: torch.empty(s) for n, s in shapes.items()} for _ in range(args.learners)]
    merge_bufs = {n: torch.empty(s) for n, s in shapes.items()}

    def one_round(reuse: bool) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        decoded = [
            {n: decode(p[n], args.codec, shapes[n], out=b[n] if reuse else None) for n in shapes}
            for p, b in zip(encoded, dec_bufs, strict=True)
        ]
        t1 = time.perf_counter()
        merged = merge(decoded, weights, method="rda", out=merge_bufs if reuse else None)
        t2 = time.perf_counter()
        opt.step(params, merged)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def memcpy() -> float:
        dst = merge_bufs  # one fragment-sized destination, M fragments of sources
        t0 = time.perf_counter()
        for bufs in dec_bufs:
            for n in shapes:
                dst[n].copy_(bufs[n])
        return time.perf_counter() - t0

    one_round(reuse=True)  # warm-up: fills the reused buffers, faults their pages in
    memcpy()
    results = {}
    for variant, reuse in (("fresh", False), ("reused", True)):
        stages = [one_round(reuse) for _ in range(args.repeats)]
        results[variant] = [statistics.median(s[i] for s in stages) for i in range(3)]
    copy_s = statistics.median(memcpy() for _ in range(args.repeats))

    total_bytes = args.learners * numel * 4
    gbps = lambda seconds: total_bytes / seconds / 1e9  # noqa: E731
    fresh, reused = (sum(results[v]) for v in ("fresh", "reused"))
    out = {
        "learners": args.learners,
        "fragment_mb": args.fragment_mb,
        "tensors": args.tensors,
        "codec": args.codec,
        "threads": args.threads,
        "repeats": args.repeats,
        "encoded_mb_per_learner": round(sum(encoded_nbytes(n, args.codec) for n in sizes) / 2**20, 3),
        "merge_gb_per_s": round(gbps(fresh), 3),
        "memcpy_gb_per_s": round(gbps(copy_s), 3),
        "ratio": round(copy_s / fresh, 3),
        "merge_gb_per_s_reused": round(gbps(reused), 3),
        "ratio_reused": round(copy_s / reused, 3),
        "seconds": {
            v: dict(zip(("decode", "merge", "step"), map(lambda s: round(s, 5), r), strict=True))
            for v, r in results.items()
        },
        "encode_gb_per_s": round(gbps(encode_s), 3),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
