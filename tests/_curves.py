"""A learner's loss curve on a prepared run, for comparing devices and precisions (`tests/gpu`).

Each curve needs a store of its own: a second learner on the same store resumes the first's data cursor
(`ddiloco.learner.resume`) and sees other batches; two stores prepared from one config give the same curve
bit for bit (`tests/integration/test_loss_curve_repeats.py` holds both on CPU)."""

from __future__ import annotations

from ddiloco.learner.loop import Learner
from ddiloco.run.prepare import prepare
from ddiloco.store.base import Store
from ddiloco.store.url import open_store
from tests._harness import tiny_config

STEPS = 30


def prepared(name: str, *overrides: str) -> Store:
    """A memory:// run `name` of the tiny config with one learner and no checkpoints, prepared."""
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, "diloco.learners=1", "train.checkpoint_every_s=100000", *overrides))
    return store


def losses(store: Store, device: str, steps: int = STEPS) -> tuple[list[float], Learner]:
    """Per-step losses of a fresh learner 0 (no syncer: inner steps only), and the closed learner."""
    learner = Learner.open(store, 0, device=device)
    learner.start()
    out = [learner.step() for _ in range(steps)]
    learner.close("max_steps")
    if device == "cuda":  # each step returns the previous step's loss; the last is read at the end
        assert out[0] is None and all(isinstance(v, float) for v in out[1:])
        out = [*out[1:], learner.loss]
    return out, learner
