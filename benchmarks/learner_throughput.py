"""Learner throughput and MFU: (a) a plain training loop and (b) the DiLoCo learner, measured in one run.

(a) plain: the learner's own inner step in a bare loop (`_learner_bench.PlainLoop`: same model from global
    version 0, same data, AdamW (fused on CUDA), precision and compile setting);
(b) learner: `ddiloco.learner.loop.Learner` on a file:// run prepared by `ddiloco.run.prepare`, answering the rounds
    of a real `ddiloco syncer` process (snapshots, uploads, new global versions, reports, checkpoints).
The two alternate in --repeats slices so drift and noise hit both; tokens/s = tokens / seconds over a mode's
slices, and overhead = 1 − learner / plain.

MFU = flops_per_token × tokens/s / peak, flops_per_token = 6·N + 12·L·C·T (`ddiloco.model.gpt.flops_per_token`:
N counts the parameters in matmuls; PaLM appendix B). Peak: dense tensor throughput from the vendor's data
sheet for known GPUs at the run's precision (`ddiloco.platform.peaks`; bf16: H100 SXM / H200 989.5 TFLOP/s; fp32
without TF32: 67), and on CPU an fp32 matmul peak measured in this process (same threads);
`peak_flops_source` says which, and an unknown GPU gets null.

    python benchmarks/learner_throughput.py [--preset tiny] [--precision auto] [--seconds 10] [--hf-arch llama]
        [--device auto] [--batch-size N] [--seq-len T] [--compile] [--repeats 3] [--set key=value ...]

Prints a table, then one JSON object as its last line. GPU presets use the byte tokenizer (no BPE training
in the benchmark), so their LM head is small; MFU counts the FLOPs the model really has.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time

import torch
from _learner_bench import PlainLoop, hf_dir_like, learner_step, prepared_run, sync, timed

from ddiloco.config.recipes import load_config
from ddiloco.learner.accel import resolve_precision
from ddiloco.learner.efficiency import device_name, device_peak
from ddiloco.learner.loop import Learner
from ddiloco.platform.devices import resolve_device
from ddiloco.run.root import RunRoot

# preset: recipe (DiLoCo settings), seq_len, batch_size, synthetic documents
PRESET_DEFAULTS = {
    "tiny": ("tiny-cpu", 128, 16, 5000),
    "small": ("tiny-cpu", 256, 16, 5000),
    "125m": ("paper-like", 1024, 32, 20000),
    "350m": ("paper-like", 1024, 16, 20000),
    "1b": ("paper-like", 1024, 8, 20000),
}


def peak_flops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s, where the figure comes from): the library's data-sheet table on CUDA (`ddiloco.platform.peaks`,
    what learners report MFU by), measured on CPU."""
    if device.type == "cuda":
        peak = device_peak(device, precision, None)
        return peak.flops, peak.source
    n, reps = 512, 0  # fp32 even for a bf16 run: without AMX, bf16 matmuls are the CPU's slow path
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        a @ b
        reps += 1
    peak = 2 * n**3 * reps / (time.perf_counter() - t0)
    return peak, f"measured: {n}x{n} fp32 matmul, {torch.get_num_threads()} thread(s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESET_DEFAULTS))
    ap.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds per mode")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--compile", action="store_true", help="torch.compile both loops")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per mode first")
    ap.add_argument("--set", action="append", default=[], dest="overrides")
    ap.add_argument(
        "--hf-arch", help="a transformers model of this model_type (e.g. llama) at the preset's size"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    recipe, seq_len, batch, docs = PRESET_DEFAULTS[args.preset]
    overrides = [
        f"model.preset={args.preset}",
        f"model.seq_len={args.seq_len or seq_len}",
        f"train.batch_size={args.batch_size or batch}",
        f"train.precision={args.precision}",
        f"train.device={args.device}",
        f"train.compile={str(args.compile).lower()}",
        "data.tokenizer=byte",
        "data.vocab_size=null",
        f"data.synthetic_docs={docs}",
        "diloco.learners=1",
        "diloco.token_budget=1000000000000000",
        *args.overrides,
    ]
    cfg = load_config(recipe, None, overrides)
    if args.hf_arch:
        path = hf_dir_like(cfg, args.hf_arch, tempfile.mkdtemp(prefix="ddiloco-hf-bench-"))
        cfg = load_config(recipe, None, [*overrides, f"model.hf={path}"])
    cfg.run_id = "bench"
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.train.threads)
    peak, peak_source = peak_flops(device, precision)
    with prepared_run(cfg) as (_, store):
        plain = PlainLoop(store, cfg, device)
        learner = Learner.open(store, 0)
        learner.start()
        plain.run(args.warmup)
        for _ in range(args.warmup):
            learner.tick()
        sync(device)
        slice_s = args.seconds / args.repeats
        totals = {"plain": [0.0, 0.0, 0], "learner": [0.0, 0.0, 0]}
        samples: dict[str, list[float]] = {"plain": [], "learner": []}
        for _ in range(args.repeats):
            for mode, fn in (("plain", lambda: plain.run(1)), ("learner", learner_step(learner))):
                tokens, seconds, steps = timed(fn, device, slice_s)
                totals[mode] = [totals[mode][0] + tokens, totals[mode][1] + seconds, totals[mode][2] + steps]
                samples[mode].append(tokens / seconds)
        status = RunRoot(store, cfg.run_id).status()
        rounds_answered = learner.exchange.rounds_answered
        learner.close("max_steps")
        losses = {"plain": plain.loss, "learner": learner.loss}
    fpt = plain.model.flops_per_token(cfg.model.seq_len)
    tps = {mode: t[0] / t[1] for mode, t in totals.items()}
    mfu = {mode: (fpt * v / peak if peak else None) for mode, v in tps.items()}
    name = device_name(device)
    print(f"{'mode':8} {'steps':>7} {'seconds':>8} {'tokens/s':>12} {'MFU':>7} {'last loss':>9}")
    for mode, (_, seconds, steps) in totals.items():
        m = "n/a" if mfu[mode] is None else f"{100 * mfu[mode]:.1f}%"
        print(f"{mode:8} {steps:7d} {seconds:8.1f} {tps[mode]:12.0f} {m:>7} {losses[mode]:9.3f}")
    overhead = 1 - tps["learner"] / tps["plain"]
    print(f"overhead {100 * overhead:.2f}% on {name} ({args.preset}, {precision}); peak: {peak_source}")
    result = {
        "device": name,
        "preset": args.preset,
        "model": args.hf_arch or "gpt",
        "params": plain.model.num_params(),
        "precision": precision,
        "compile": cfg.train.compile,
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.model.seq_len,
        "fragments": cfg.diloco.fragments,
        "sync_every": cfg.diloco.sync_every,
        "codec": cfg.diloco.codec,
        "tokens_per_s_plain": tps["plain"],
        "tokens_per_s_learner": tps["learner"],
        "overhead": overhead,
        "mfu_plain": mfu["plain"],
        "mfu_learner": mfu["learner"],
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "seconds_per_mode": args.seconds,
        "repeats": args.repeats,
        "plain_samples": samples["plain"],
        "learner_samples": samples["learner"],
        "rounds_answered": rounds_answered,
        "rounds_merged": status.rounds_merged if status else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
