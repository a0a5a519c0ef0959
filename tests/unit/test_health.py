"""The merge bound's arithmetic (`ddiloco.learner.health.MergeBound`) and its config key."""

import math

import pytest

from ddiloco.config.run import DilocoConfig
from ddiloco.errors import ConfigError
from ddiloco.learner.health import UNMERGED_MIN_S, MergeBound, Unmerged
from tests._harness import status, tiny_config


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_default_bound_follows_the_pace_above_a_generous_floor():
    bound = MergeBound(0, None, DilocoConfig(sync_every=500, fragments=24))
    assert bound.bound_s(None) == UNMERGED_MIN_S == 1800  # before the first step is measured
    assert bound.bound_s(0.05) == UNMERGED_MIN_S  # fast steps: the floor
    assert bound.bound_s(2.0) == 20 * 500 * 2.0  # a 1b learner at 2 s a step: 20 syncs of a fragment
    assert bound.silent_s(2.0) == max(120, 4 * 500 / 24 * 2.0)
    assert MergeBound(0, 90.0, DilocoConfig()).bound_s(2.0) == 90.0  # train.max_unmerged_s wins


def test_time_counts_only_while_the_status_changes_and_the_store_answers_and_a_merge_restarts_it():
    clock = Clock()
    bound = MergeBound(0, 200.0, DilocoConfig(sync_every=4, fragments=2), clock)
    bound.begin()
    for t in range(1, 6):  # a live syncer: its status changes every check
        clock.t += 10
        bound.check(status(time=t), merged_tokens=0, store_errors=0, step_s=0.01)
    assert bound.unmerged_s == 50
    clock.t += 10
    bound.check(status(time=6), merged_tokens=0, store_errors=1, step_s=0.01)  # a store error: not counted
    assert bound.unmerged_s == 50
    clock.t += 10
    bound.check(status(time=7), merged_tokens=128, store_errors=1, step_s=0.01)  # merged: from zero
    assert bound.unmerged_s == 0
    for _ in range(100):  # the status stops changing: at most the silent window counts
        clock.t += 10
        bound.check(status(time=7), merged_tokens=128, store_errors=1, step_s=0.01)
    assert bound.unmerged_s == 120  # the window from the last change (at the merge)
    with pytest.raises(Unmerged, match="train.max_unmerged_s"):
        for t in range(8, 20):
            clock.t += 10
            bound.check(status(time=t), merged_tokens=128, store_errors=1, step_s=0.01)


@pytest.mark.parametrize("value", [0, -5, math.nan, math.inf])
def test_max_unmerged_s_must_be_a_positive_number_of_seconds(value):
    with pytest.raises(ConfigError, match="train.max_unmerged_s"):
        tiny_config("bound", f"train.max_unmerged_s={value}")
