"""The syncer's round at scale: the real read → decode → merge → outer step → publish path, one fragment at a time.

Each measured round drives the syncer's own parts on synthetic answers of the real layout
(`ddiloco.globalmodel.make_layout` on a meta-device model, so no full model is ever allocated):

1. untimed setup: fragment p's global version 0 is published (random fp32) and read back into a
   `GlobalFragment` (`SyncerFiles.load_fragment`, outer momentum in steady state); M learners' answers are
   generated one at a time, packed the learner's way (`ddiloco.learner.io.pack_update`: the upload codec of
   `ddiloco.compression` + `ddiloco.protocol.wire`) and put in the store;
2. timed: `Intake.collect` (list, get, unpack, verify and check each answer on `--threads` workers, then
   decode it chunk by chunk into the round's running sums, `ddiloco.encoded` + `ddiloco.accumulate`;
   workers read ahead while the sums grow), `GlobalFragment.propose` (finalise the sums,
   Nesterov step), `SyncerFiles.publish` (momentum, round record, the download delta against the
   previous version as `--download-codec`, global + pointer) and
   `GlobalFragment.commit`. The memory-bandwidth yardstick is timed right after each answer's merge, on
   the same thread: one plain `copy_` of the answer's fp32 worth between two fragment-sized buffers (M per
   round). The machine is shared and its memory bandwidth drifts by ±20% over seconds; measured in
   alternation, merge and copy see the same conditions (and, with readers, the same reads going on);
   the yardstick's buffers are allocated and touched before anything else and subtracted from
   ``peak_rss_bytes`` (``yardstick_bytes``). After the round the same M copies run back to back
   (``memcpy_block_gbps``, the yardstick as it was measured before 2026-11-25, for comparison);
3. everything of fragment p is dropped before the next round. Unless `--no-resident`, the other fragments'
   fp32 Θ and momentum are held all along (pages touched), as a real syncer holds them, so
   `peak_rss_bytes` is the syncer's and compares with `model_bytes`.

Rounds visit fragments largest first (a round of the largest fragment is what paces the syncer).
``merge_gbps`` = M × fragment fp32 bytes / merge seconds: the time the syncer spends merging, i.e. adding
each accepted answer to the round's running sums (`Intake`'s accept: decode chunk by chunk and add) plus
finalising the sums (`RoundSums.finalize`); fetching and verifying answers (on the intake's workers,
overlapped with the merge), the outer step and publishing are not merging and are in ``round_seconds``.
``round_gbps`` = the same bytes over the whole round, ``memcpy_gbps`` over the copy's seconds;
``stage_seconds`` splits the merge into ``accept`` and ``finalize``. The first round pays for fresh memory
(its sums and merged gradient come from the OS: ~0.6 s of page faults at the 1b preset, 3x its merge),
which a syncer process pays once; later rounds reuse buffers of closed rounds (`ddiloco.bufferpool`), as a
running syncer does, and the yardstick faults its destination in before it is timed. So the medians are
the steady state, over the rounds after the first (all rounds when there is only one), and the first
round is reported on its own as ``first_round``. ``--whole-tensors`` uses the layout without row
pieces (what every run used before tensors above the ideal fragment were split), for comparison.
Vocabulary and context default per preset (tiny, small: byte tokenizer; larger: GPT-2's 50304 and 1024).

    .venv/bin/python benchmarks/syncer_scale.py --preset 1b --fragments 24 --learners 16 --codec int4 \
        --rounds 3 [--threads 1] [--store memory|file] [--whole-tensors] [--global-dtype fp32]

Prints one line per round, then one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import shutil
import statistics
import tempfile
import time
from functools import partial

import torch
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.compression import CODECS, encoded_nbytes
from ddiloco.config import DilocoConfig
from ddiloco.downlink import DOWNLOAD_CODECS
from ddiloco.fragments import imbalance, partition
from ddiloco.globalmodel import Layout, make_layout, publish_global
from ddiloco.learner.accel import HostSnapshot
from ddiloco.learner.io import pack_update
from ddiloco.metrics import SyncerMetrics
from ddiloco.model import GPT, gpt_config
from ddiloco.protocol.messages import Ledger
from ddiloco.recipes import load_config
from ddiloco.store.url import open_store
from ddiloco.syncer.fragment import MergeRule
from ddiloco.syncer.intake import Intake, UpdateValidator, split_threads
from ddiloco.syncer.rounds import Round
from ddiloco.syncer.state import SyncerFiles

# preset: (vocab_size, context length)
PRESET_DEFAULTS = {
    "tiny": (258, 128),
    "small": (258, 256),
    "125m": (50304, 1024),
    "350m": (50304, 1024),
    "1b": (50304, 1024),
}
STEPS = 24  # c_steps of the first answer (H = 24); answer m claims STEPS - m steps


def layout_of(preset: str, vocab: int, block: int, P: int, whole: bool) -> Layout:
    with torch.device("meta"):
        model = GPT(gpt_config(preset, vocab_size=vocab, block_size=block))
    layout = make_layout(model, P)
    if whole:
        numels = {n: p.numel() for n, p in model.named_parameters()}
        shapes = {n: list(p.shape) for n, p in model.named_parameters()}
        layout = Layout(partition(numels, P), shapes, model.embedding_names(), layout.model)
    return layout


class Yardstick:
    """Two touched fp32 buffers of the largest fragment's size: `copy(numel)` times one plain copy."""

    def __init__(self, numel: int) -> None:
        self.src = torch.full((numel,), 1e-3)
        self.dst = torch.empty(numel).copy_(self.src)  # pages faulted in before anything is timed

    @property
    def nbytes(self) -> int:
        return 8 * self.src.numel()

    def copy(self, numel: int) -> float:
        """Seconds one copy of `numel` values takes."""
        c0 = time.perf_counter()
        self.dst[:numel].copy_(self.src[:numel])
        return time.perf_counter() - c0


def one_round(
    s: int,
    p: int,
    args: argparse.Namespace,
    cfg,
    layout: Layout,
    store,
    g: torch.Generator,
    yardstick: Yardstick,
) -> dict[str, float]:
    files = SyncerFiles(store, cfg.run_id, layout, None, args.global_dtype, args.download_codec)
    rule = MergeRule.of(cfg.diloco, layout, None)
    names = layout.fragments[p].names
    theta = {n: torch.randn(layout.shapes[n], generator=g).mul_(0.02) for n in names}
    publish_global(store, cfg.run_id, p, 0, theta, args.global_dtype)
    del theta
    frag = files.load_fragment(p, 0, Ledger(), rule)
    frag.outer.load_state_dict({n: torch.zeros(layout.shapes[n]) for n in names})  # steady state
    tokens_per_step = cfg.train.max_batch() * cfg.model.seq_len
    for m in range(args.learners):
        delta = {n: torch.randn(layout.shapes[n], generator=g).mul_(1e-3) for n in names}
        header = {
            "run_id": cfg.run_id,
            "kind": "update",
            "learner_id": m,
            "incarnation": 0,
            "fragment_id": p,
            "round": s,
            "base_version": 0,
            "c_steps": STEPS - m % STEPS,  # unequal weights; tokens are exact per step (`protocol.claims`)
            "c_tokens": (STEPS - m % STEPS) * tokens_per_step,
            "c_seconds": 10.0,
            "inner_step": 1000,
            "codec": args.codec,
        }
        store.put(
            keys.update_key(p, s, m, 0), pack_update(HostSnapshot(delta, None), args.codec, header, None)
        )
        del delta
    merge_s = [0.0, 0.0]  # accept (decode + add), finalize

    numel = layout.fragments[p].numel
    copy_s = [0.0]  # the yardstick's copies beside the merge

    def timed_accept(rnd: Round, ans) -> None:  # the merge proper: decode + add to the running sums
        a0 = time.perf_counter()
        frag.accept(rnd, ans, rule)
        merge_s[0] += time.perf_counter() - a0
        copy_s[0] += yardstick.copy(numel)  # the same bytes, plainly copied, right after

    validator = UpdateValidator(cfg, layout, {p: frag}, key=None, wall=time.time)  # type: ignore[arg-type]
    metrics = SyncerMetrics(CollectorRegistry(), dict)
    intake = Intake(
        store,
        validator,
        metrics,
        clock=time.monotonic,
        wall=time.time,
        on_notice=lambda: None,
        accept=timed_accept,
        threads=args.threads,
    )
    rnd = Round(round=s, fragment_id=p, opened_at=time.monotonic(), opened_wall=time.time())
    gc.collect()

    t0 = time.perf_counter()
    intake.collect(rnd)
    t1 = time.perf_counter()
    finalize = rnd.sums.finalize  # type: ignore[union-attr]

    def timed_finalize(*a, **kw):
        f0 = time.perf_counter()
        try:
            return finalize(*a, **kw)
        finally:
            merge_s[1] += time.perf_counter() - f0

    rnd.sums.finalize = timed_finalize  # type: ignore[union-attr,method-assign]
    proposal = frag.propose(rnd.answers, rule, rnd.sums, partial(intake.reread, rnd))
    t2 = time.perf_counter()
    record = proposal.record(rnd, now=time.monotonic(), merged_at=time.time())
    files.publish(proposal, record)
    t3 = time.perf_counter()
    frag.commit(proposal, published_at=time.time(), clock=time.monotonic(), dtype=args.global_dtype)
    rnd.sums.release()  # type: ignore[union-attr]  # as the syncer's loop does after a merge
    t4 = time.perf_counter()
    if len(rnd.answers) != args.learners or intake.rejected:
        raise SystemExit(f"round {s}: {len(rnd.answers)} answers accepted, rejected {dict(intake.rejected)}")

    for prefix in (
        keys.fragment_updates_prefix(p),
        keys.global_prefix(p),
        keys.momentum_prefix(p),
        keys.ROUNDS,
    ):
        for key in store.list(prefix):
            store.delete(key)
    block_s = sum(
        yardstick.copy(numel) for _ in range(args.learners)
    )  # the former yardstick, after the round
    return {
        "intake": t1 - t0 - copy_s[0],  # the copies ran inside collect, after each accept
        "propose": t2 - t1,
        "publish": t3 - t2,
        "commit": t4 - t3,
        "merge": merge_s[0] + merge_s[1],
        "accept": merge_s[0],
        "finalize": merge_s[1],
        "copy": copy_s[0],
        "copy_block": block_s,
    }


def resident_state(layout: Layout, measured: int) -> list[torch.Tensor]:
    """What a real syncer holds between rounds for every other fragment: the fp32 master Θ and the outer
    momentum, pages touched (an untouched allocation is not resident and would flatter peak RSS)."""
    held = []
    for f in layout.fragments:
        if f.fragment_id != measured:
            for _ in ("theta", "momentum"):
                held.append(torch.empty(f.numel).fill_(1e-3))
    return held


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESET_DEFAULTS))
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: per preset)")
    ap.add_argument("--seq-len", type=int, default=None, help="context length (default: per preset)")
    ap.add_argument("--fragments", type=int, default=24, help="P")
    ap.add_argument("--learners", type=int, default=16, help="M, answers merged per round")
    ap.add_argument("--codec", choices=CODECS, default="int4")
    ap.add_argument("--global-dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument(
        "--download-codec",
        choices=DOWNLOAD_CODECS,
        default=DilocoConfig().download_codec,
        help="what publishing writes besides the full version (default: the config's)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--store", choices=("memory", "file"), default="memory")
    ap.add_argument("--whole-tensors", action="store_true", help="the layout without row pieces")
    ap.add_argument(
        "--no-resident",
        dest="resident",
        action="store_false",
        help="do not hold the other fragments' Θ and momentum (peak RSS then counts one fragment's round)",
    )
    args = ap.parse_args()
    torch.set_num_threads(split_threads(args.threads)[1])  # as the syncer splits its threads
    vocab, block = PRESET_DEFAULTS[args.preset]
    vocab, block = args.vocab or vocab, args.seq_len or block
    layout = layout_of(args.preset, vocab, block, args.fragments, args.whole_tensors)
    cfg = load_config(None, None, [f"diloco.codec={args.codec}", f"diloco.fragments={args.fragments}"])
    cfg.run_id = "syncer-scale"
    tmp = tempfile.mkdtemp(prefix="syncer-scale-") if args.store == "file" else None
    store = open_store(f"file://{tmp}" if tmp else f"memory://syncer-scale-{time.time_ns()}")
    order = sorted(range(args.fragments), key=lambda p: (-layout.fragments[p].numel, p))
    yardstick = Yardstick(layout.fragments[order[0]].numel)  # first: resident throughout, subtracted exactly
    resident = resident_state(layout, order[0]) if args.resident else []
    g = torch.Generator().manual_seed(0)
    rounds = []
    try:
        for s in range(args.rounds):
            p = order[s % len(order)]
            t = one_round(s, p, args, cfg, layout, store, g, yardstick)
            numel = layout.fragments[p].numel
            total = sum(
                v for k, v in t.items() if k not in ("copy", "copy_block", "merge", "accept", "finalize")
            )
            rounds.append({"fragment": p, "numel": numel, "seconds": total, **t})
            mb = args.learners * 4 * numel / 1e6
            print(
                f"round {s} fragment {p}: {numel / 1e6:.1f}M values, {total:.3f}s, merge {t['merge']:.3f}s"
                f" ({mb / 1e3 / t['merge']:.2f} GB/s, copy {mb / 1e3 / t['copy']:.2f} GB/s)"
            )
            gc.collect()
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    total_numel = sum(f.numel for f in layout.fragments)
    steady = rounds[1:] or rounds  # module docstring: the first round pays for fresh memory
    rate = lambda r, key: args.learners * 4 * r["numel"] / r[key] / 1e9  # noqa: E731
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    gbps = lambda key: statistics.median(rate(r, key) for r in steady)  # noqa: E731
    out = {
        "preset": args.preset,
        "vocab_size": vocab,
        "fragments": args.fragments,
        "learners": args.learners,
        "codec": args.codec,
        "global_dtype": args.global_dtype,
        "download_codec": args.download_codec,
        "threads": args.threads,
        "store": args.store,
        "layout": "whole_tensors" if args.whole_tensors else "row_pieces",
        "pieces": len(layout.pieces),
        "model_bytes": 4 * total_numel,
        "resident_other_fragments": args.resident,
        "resident_bytes": sum(t.numel() * 4 for t in resident),
        "ideal_fragment_bytes": 4 * total_numel / args.fragments,
        "fragment_bytes_max": 4 * max(f.numel for f in layout.fragments),
        "fragment_bytes_max_over_ideal": round(imbalance(layout.fragments), 4),
        "encoded_bytes_per_answer_max": sum(
            encoded_nbytes(math.prod(layout.shapes[n]), args.codec) for n in layout.fragments[order[0]].names
        ),
        "rounds": len(rounds),
        "steady_rounds": len(steady),
        "round_seconds": _sig(med("seconds")),
        "round_seconds_max": _sig(max(r["seconds"] for r in rounds)),
        "first_round": {
            "seconds": _sig(rounds[0]["seconds"]),
            "merge_seconds": _sig(rounds[0]["merge"]),
            "merge_gbps": _sig(rate(rounds[0], "merge")),
            "memcpy_gbps": _sig(rate(rounds[0], "copy")),
        },
        "stage_seconds": {
            k: _sig(med(k)) for k in ("intake", "propose", "publish", "commit", "merge", "accept", "finalize")
        },
        "merge_gbps": _sig(gbps("merge")),
        "round_gbps": _sig(gbps("seconds")),
        "memcpy_gbps": _sig(gbps("copy")),
        "memcpy_block_gbps": _sig(gbps("copy_block")),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - yardstick.nbytes,
        "yardstick_bytes": yardstick.nbytes,
        "per_round": [{k: (_sig(v) if isinstance(v, float) else v) for k, v in r.items()} for r in rounds],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
