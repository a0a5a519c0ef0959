"""A hostile direction with honest counts (issue 49, measurement 3), in deterministic in-process runs.

Learners 0-2 train honestly; in every round an extra learner id answers with learner 0's header (its
counters, so its token weight is an honest one) and a random direction at 100× the norm of learner 0's
answer. Without a robust merge the run is ruined; under `diloco.robust_merge: trimmed_mean` (rounds of
four answers: the largest and smallest value of each coordinate dropped) the final validation loss stays
within 5% of a clean run's. The harness is `test_bad_inputs`' (one thread, a clock that advances one second
per pass, no grace window), with K = M = 3.
"""

from __future__ import annotations

import math

import pytest
import torch

from ddiloco import keys
from ddiloco.posttrain.evaluate import run_validation_loss
from ddiloco.protocol import wire
from ddiloco.run.globalmodel import read_layout
from ddiloco.run.root import RunRoot
from tests.integration import test_bad_inputs as bad_inputs
from tests.integration.test_bad_inputs import Run, put

SETTINGS = ("diloco.token_budget=12000", "diloco.learners=3", "diloco.quorum=3")
HOSTILE_ID = 90


def hostile_direction(scale: float = 100.0):
    """After learner 0 answered an open round s, file a random direction at `scale` × its norm as the answer
    of learner 90 + s, with learner 0's counters (a token weight as honest as learner 0's)."""
    done: set[int] = set()

    def after(r: Run, _: int) -> None:
        for s in sorted(r.syncer.rounds.open):
            key = keys.update_key(s % r.syncer.P, s, 0, 0)
            if s in done or not r.store.exists(key):
                continue
            src = wire.unpack(r.store.get(key), expect={"kind": "update"}, key=r.key)
            gen = torch.Generator().manual_seed(s)
            noise = {n: torch.randn(t.shape, generator=gen) for n, t in src.tensors.items()}
            ratio = scale * _norm(src.tensors) / _norm(noise)
            meta = {**src.meta, "learner_id": HOSTILE_ID + s}
            meta.pop("norms", None)  # claims nothing: the syncer measures
            put(
                r,
                s,
                f"{HOSTILE_ID + s:03d}-0000.safetensors",
                wire.pack({n: t * ratio for n, t in noise.items()}, meta, key=r.key),
            )
            done.add(s)

    return after


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().norm()) ** 2 for t in tensors.values()))


def run(name: str, *overrides: str, after=None) -> Run:
    """`test_bad_inputs.run` with three learners: a deterministic in-process run to its end."""
    return bad_inputs.run(name, *SETTINGS, *overrides, after=after, learners=3, passes=20000)


def final_loss(r: Run) -> float:
    root = RunRoot(r.store, r.name, r.key)
    model = root.final_model(read_layout(r.store))
    return run_validation_loss(model, root.val(), root.config())


@pytest.mark.slow
def test_a_hundredfold_hostile_direction_with_honest_counts_is_trimmed_away():
    clean = final_loss(run("trim-clean"))
    attacked = run("trim-attacked", "diloco.robust_merge=trimmed_mean", after=hostile_direction())
    control = final_loss(run("trim-control", after=hostile_direction()))
    trimmed = attacked.syncer.books.clipped["trimmed_mean"]
    assert trimmed >= 5 and attacked.syncer.intake.rejected.total() == 0
    loss = final_loss(attacked)
    assert loss <= 1.05 * clean, (loss, clean, control)
    assert control > 1.3 * clean, (control, clean)  # measured 5.5x (at 12000 tokens): the attack does harm
