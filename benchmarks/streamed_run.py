"""A whole local run over a pre-tokenized corpus read in place, with a learner killed mid-run, at two corpus sizes.

For each size, writes `--files` `.npy` files of random uint16 byte ids (`--tokens-per-file` each, and then
a tenth of that), then runs `ddiloco.launch.LocalRun` (real processes: syncer, `--learners` learners; tiny
model; learner 1 SIGKILLs itself at inner step `--kill-at-step` and is restarted) to `--budget` merged
tokens. Prints ONE JSON line with, per size: the corpus bytes, the run root's data bytes (`data/`: the
validation split, tokenizer, manifest and plan) and total bytes, prepare seconds, `tokens_read_twice`,
`ledger_balanced`, incarnations, and each learner's `peak_rss_bytes`; and `rss_growth_bytes`: the largest
per-learner peak at the big corpus minus the same at the small one (the issue's bound: ~300 MB).

    .venv/bin/python benchmarks/streamed_run.py --files 8 --tokens-per-file 50000000
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.seq_len=64", "train.batch_size=8",
        "train.heartbeat_every_s=0.5", "train.warmup_steps=2", "diloco.fragments=2", "diloco.sync_every=8",
        "eval.val_batches=4", "eval.items_per_task=8", "sft=null", "data.tokenizer=byte"]  # fmt: skip


def write_corpus(path: Path, files: int, per_file: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    for i in range(files):
        np.save(path / f"part-{i:03d}.npy", rng.integers(0, 256, per_file, dtype=np.uint16))
    return sum(f.stat().st_size for f in path.glob("*.npy"))


def one_size(work: Path, args: argparse.Namespace, per_file: int) -> dict:
    from ddiloco.launch import LocalRun
    from ddiloco.store.url import open_store
    from tests._harness import tiny_config

    corpus = work / f"corpus-{per_file}"
    corpus_bytes = write_corpus(corpus, args.files, per_file, args.seed)
    kill = f"chaos.events=[{{kind: kill_learner, learner: 1, at_step: {args.kill_at_step}}}]"
    cfg = tiny_config(
        f"streamed-{per_file}", *TINY, f"data.source={corpus}", f"diloco.learners={args.learners}",
        f"diloco.token_budget={args.budget}", kill,
    )  # fmt: skip
    t0 = time.monotonic()
    run = LocalRun(cfg, work / "runs")
    s = run.run(timeout=args.timeout)
    store = open_store(run.url)
    sizes = store.sizes()
    out = {
        "corpus_tokens": args.files * per_file,
        "corpus_bytes": corpus_bytes,
        "run_root_data_bytes": sum(n for k, n in sizes.items() if k.startswith("data/")),
        "run_root_bytes": sum(sizes.values()),
        "seconds": round(time.monotonic() - t0, 1),
        "status": s.status,
        "ledger_balanced": s.ledger_balanced,
        "tokens_read_twice": s.tokens_read_twice,
        "incarnations": s.incarnations,
        "peak_rss_bytes": {k: a["peak_rss_bytes"] for k, a in s.learner_accounting.items()},
        "tokens_merged": s.tokens_merged,
        "final_val_loss": s.final_val_loss,
    }
    shutil.rmtree(corpus)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--tokens-per-file", type=int, default=50_000_000)
    ap.add_argument("--learners", type=int, default=3)
    ap.add_argument("--budget", type=int, default=300_000)
    ap.add_argument("--kill-at-step", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ddiloco-streamed-") as tmp:
        big = one_size(Path(tmp) / "big", args, args.tokens_per_file)
        small = one_size(Path(tmp) / "small", args, args.tokens_per_file // 10)
    growth = max(big["peak_rss_bytes"].values()) - max(small["peak_rss_bytes"].values())
    print(json.dumps({"big": big, "small": small, "rss_growth_bytes": growth}, sort_keys=True))


if __name__ == "__main__":
    main()
