"""Shared by the learner benchmarks: a prepared store with a real syncer process, the plain loop, timing.

The plain loop is the learner's own inner step (`ddiloco.learner.accel.train_step`: same model from global version 0,
same data loader, same AdamW, precision and compile setting) without any of the DiLoCo machinery. Both
paths read each step's loss one step late on CUDA, as the learner does, and synchronise the device at the
end of every timed slice, so tokens/s are what the device really sustained.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

from ddiloco.config.run import RunConfig
from ddiloco.data.loader import ShardLoader
from ddiloco.learner.accel import maybe_compile, resolve_precision, to_device, train_step
from ddiloco.learner.loop import Learner
from ddiloco.model.gpt import configure_optimizer
from ddiloco.run.globalmodel import build_model, model_config_from_run, read_layout
from ddiloco.run.prepare import prepare
from ddiloco.run.root import RunRoot
from ddiloco.run.schedule import lr_at
from ddiloco.store.base import Store
from ddiloco.store.url import open_store


@contextlib.contextmanager
def prepared_run(cfg: RunConfig, syncer_threads: int = 1) -> Iterator[tuple[str, Store]]:
    """A file:// run prepared from `cfg` with `ddiloco syncer` running in its own process."""
    with tempfile.TemporaryDirectory(prefix="ddiloco-bench-") as tmp:
        url = f"file://{tmp}/{cfg.run_id}"
        store = open_store(url)
        prepare(store, cfg)
        syncer = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.cli", "syncer", "--store", url],
            env={**os.environ, "OMP_NUM_THREADS": str(syncer_threads)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            yield url, store
        finally:
            syncer.kill()
            syncer.wait()


def hf_dir_like(cfg: RunConfig, model_type: str, path: str) -> str:
    """A Hugging Face config directory of `model_type` with the run's model sizes (layers, width, heads,
    context, byte vocabulary) and a 4x MLP, so the HF path is measured at the preset's size."""
    from transformers import AutoConfig

    m = model_config_from_run(cfg, 258)
    AutoConfig.for_model(
        model_type,
        vocab_size=258,
        hidden_size=m.n_embd,
        intermediate_size=4 * m.n_embd,
        num_hidden_layers=m.n_layer,
        num_attention_heads=m.n_head,
        num_key_value_heads=m.n_head,
        max_position_embeddings=m.block_size,
    ).save_pretrained(path)
    return path


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PlainLoop:
    """The learner's inner step in a bare loop (see the module docstring)."""

    def __init__(self, store: Store, cfg: RunConfig, device: torch.device) -> None:
        t = cfg.train
        layout = read_layout(store)
        self.model = build_model(layout, cfg.seed)
        with torch.no_grad():
            for p in range(layout.num_fragments):
                for name, v in RunRoot(store, cfg.run_id).read_global(layout, p, 0).items():
                    dict(self.model.named_parameters())[name].copy_(v)
        self.model.to(device)
        self.opt = configure_optimizer(self.model, t.lr, t.weight_decay, (t.beta1, t.beta2))
        self.net = maybe_compile(self.model, t.compile)
        self.loader = ShardLoader(
            RunRoot(store, cfg.run_id).shard(0),
            batch_size=t.batch_size,
            seq_len=cfg.model.seq_len,
            seed=cfg.seed * 1000,
        )
        self.cfg, self.device = cfg, device
        self.precision = resolve_precision(t.precision, device)
        self.step, self.loss = 0, None
        self._in_flight: torch.Tensor | None = None

    def run(self, steps: int) -> float:
        """Take `steps` steps; returns the tokens they covered."""
        t = self.cfg.train
        for _ in range(steps):
            x, y = self.loader.next_batch()
            loss = train_step(
                self.net,
                self.opt,
                to_device(x, self.device),
                to_device(y, self.device),
                lr_at(self.step, t.lr, t.warmup_steps),
                t.grad_clip,
                precision=self.precision,
            )
            if self.device.type == "cuda":
                loss, self._in_flight = self._in_flight, loss
            if loss is not None:
                self.loss = float(loss)
            self.step += 1
        return steps * self.loader.tokens_per_batch


def timed(fn, device: torch.device, seconds: float) -> tuple[float, float, int]:
    """Call `fn()` (one step; returns tokens) for about `seconds`; returns (tokens, elapsed, steps)."""
    sync(device)
    t0 = time.perf_counter()
    tokens, steps = 0.0, 0
    while time.perf_counter() - t0 < seconds:  # the host runs at most a step ahead (losses are read)
        tokens += fn()
        steps += 1
    sync(device)
    return tokens, time.perf_counter() - t0, steps


def learner_step(learner: Learner):
    """One learner tick as a `timed` step."""

    def fn() -> float:
        learner.tick()
        return learner.loader.tokens_per_batch * learner.world_size

    return fn
