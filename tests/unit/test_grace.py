"""The adaptive grace window: clamp(γ·(τ·ξ_round − ξ_quorum − ξ_sync), 0, cap), ξ_round = (H/P)·ξ_step."""

import pytest

from ddiloco.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from tests._harness import tiny_config


def syncer(name: str, *overrides: str) -> Syncer:
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, *overrides))
    s = Syncer(store)
    s.xi_step = lambda: 0.010  # type: ignore[method-assign]  # the learners' median step time
    return s


def test_the_window_spans_tau_rounds_of_h_over_p_steps():
    s = syncer("grace-a", "diloco.sync_every=32", "diloco.fragments=4", "diloco.overlap=2")
    s.books.xi_quorum, s.books.xi_sync = 0.030, 0.020
    assert s.grace_window() == pytest.approx(1.0 * (2 * 8 * 0.010 - 0.030 - 0.020))


def test_with_h_equal_p_it_is_the_papers_tau_steps():
    s = syncer("grace-b", "diloco.sync_every=4", "diloco.fragments=4", "diloco.overlap=2")
    s.books.xi_quorum, s.books.xi_sync = 0.0, 0.0
    assert s.grace_window() == pytest.approx(2 * 0.010)


def test_clamped_to_zero_and_to_the_cap():
    s = syncer("grace-c", "diloco.sync_every=32", "diloco.fragments=2", "diloco.grace.cap_seconds=0.05")
    s.books.xi_quorum, s.books.xi_sync = 0.0, 0.0
    assert s.grace_window() == 0.05
    s.books.xi_quorum = 10.0
    assert s.grace_window() == 0.0
    assert syncer("grace-d", "diloco.grace=null").grace_window() == 0.0
