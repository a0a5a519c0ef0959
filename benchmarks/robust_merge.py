"""Peak memory and time of one robust finalise (`diloco.robust_merge: trimmed_mean`) at a realistic fragment
size: M answers of `--params` values each, int4 encoded as the syncer keeps them (`ddiloco.syncer.merge.robust`).

Prints one JSON object: the encoded bytes the round keeps, the resident memory before the finalise and its
peak during it (VmHWM, reset first), and the seconds of the plain merge and of the trimmed one on the same
answers.
Usage: python benchmarks/robust_merge.py --params 50000000 --answers 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import time

import torch

from ddiloco.codec.encoded import EncodedTensor
from ddiloco.codec.registry import encode
from ddiloco.syncer.merge.accumulate import RoundSums

log = logging.getLogger(__name__)


def rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB, from /proc."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=int, default=50_000_000)
    ap.add_argument("--answers", type=int, default=16)
    ap.add_argument("--codec", default="int4")
    ap.add_argument("--trim", type=float, default=0.2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # a few tensors as a fragment has them: one large matrix and some smaller ones
    big = args.params * 3 // 4
    rest = args.params - big
    shapes = {"h.0.mlp.w": (big // 1024, 1024), "h.0.attn.w": (rest // 1024, 1024)}
    numel = sum(a * b for a, b in shapes.values())
    g = torch.Generator().manual_seed(0)
    kept_bytes = 0
    answers = []
    for _ in range(args.answers):
        enc = {}
        for n, s in shapes.items():
            parts = encode(torch.randn(s, generator=g), args.codec)
            kept_bytes += sum(p.numel() * p.element_size() for p in parts.values())
            enc[n] = EncodedTensor.check(parts, args.codec, s, measure=True)
        answers.append(enc)
    out = {"params": numel, "answers": args.answers, "codec": args.codec, "threads": args.threads}
    out["kept_encoded_mb"] = kept_bytes / 2**20
    out["fragment_fp32_mb"] = numel * 4 / 2**20
    for trim in (None, args.trim):
        sums = RoundSums(shapes, trim=trim)
        for i, a in enumerate(answers):
            sums.add_encoded(f"{i:02d}", 1.0 + i % 3, a)
        with open("/proc/self/clear_refs", "w") as f:  # resets the peak (VmHWM) to the current RSS
            f.write("5")
        rss0, _ = rss_mb()
        t0 = time.perf_counter()
        done = sums.finalize(lambda k, out=None: None)  # no clip, several answers: no second read
        seconds = time.perf_counter() - t0
        rss1, peak = rss_mb()
        name = "plain" if trim is None else "trimmed"
        out[f"{name}_finalize_s"] = round(seconds, 3)
        out[f"{name}_rss_before_mb"], out[f"{name}_rss_after_mb"] = round(rss0), round(rss1)
        out[f"{name}_peak_rss_mb"] = round(peak)
        out[f"{name}_peak_above_before_mb"] = round(peak - rss0)
        del done, sums
    out["peak_rss_mb_self"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


if __name__ == "__main__":
    main()
