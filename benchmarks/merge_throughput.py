"""Throughput of the syncer's merge path for one fragment, against a plain memory copy of the same bytes.

One round is what the syncer runs (`ddiloco.syncer.merge.accumulate.RoundSums`): each learner's encoded delta
(``--codec``) checked and decoded chunk by chunk into the round's running sums (``decode`` in the JSON,
decode and add in one pass), the RDA finalisation (``merge``), one ``OuterNesterov`` step (``step``).
``merge_gb_per_s`` = M x fragment fp32 bytes / seconds per round; ``memcpy_gb_per_s`` times
``dst.copy_(src)`` over the same M x fragment bytes in the same process, so ``ratio`` says how close the
merge comes to streaming its inputs once. Two variants are timed: ``fresh`` allocates the sums and the
merged gradient every round (first-touch page faults), ``reused`` takes them from a ``BufferPool`` kept
across rounds, as the syncer does. Prints one JSON object as its last line.

    .venv/bin/python benchmarks/merge_throughput.py --learners 8 --fragment-mb 64 --codec int4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ddiloco.codec.encoded import EncodedTensor
from ddiloco.codec.registry import CODECS, encode, encoded_nbytes
from ddiloco.syncer.merge.accumulate import RoundSums
from ddiloco.syncer.merge.bufferpool import BufferPool
from ddiloco.syncer.merge.outer import OuterNesterov, token_weight


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

    src = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(args.learners)]
    dst = {n: torch.empty(s) for n, s in shapes.items()}
    pool = BufferPool()

    def reread(key: str, out=None) -> dict[str, torch.Tensor]:  # RDA's rare fallback only
        return {n: EncodedTensor.check(encoded[int(key)][n], args.codec, shapes[n]).decode() for n in shapes}

    def one_round(reuse: bool) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        sums = RoundSums(shapes, method="rda", pool=pool if reuse else None)
        for m, parts in enumerate(encoded):
            checked = {n: EncodedTensor.check(parts[n], args.codec, shapes[n]) for n in shapes}
            sums.add_encoded(str(m), weights[m], checked)
        t1 = time.perf_counter()
        done = sums.finalize(reread, scale=-1.0)
        t2 = time.perf_counter()
        opt.step(params, done.merged)
        t3 = time.perf_counter()
        sums.recycle(done)
        sums.release()
        return t1 - t0, t2 - t1, t3 - t2

    def memcpy() -> float:
        t0 = time.perf_counter()  # one fragment-sized destination, M fragments of sources
        for bufs in src:
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
