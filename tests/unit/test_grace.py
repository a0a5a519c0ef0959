"""The adaptive grace window (`ddiloco.syncer.rounds`): max(γ·(τ·ξ_step + min(ξ_link, cap) − ξ_quorum − ξ_sync), 0).

What it promises: a fast learner loses at most τ of its H steps per fragment sync to waiting on late
*compute* (the paper's τ/H, whatever H/P is), while answers that are late because of their *links* are
waited for, up to `cap` seconds of transport."""

import threading

import pytest

from ddiloco import keys
from ddiloco.learner.io import StatusPoller
from ddiloco.learner.loop import Learner
from ddiloco.protocol.messages import OpenRound
from ddiloco.protocol.update import UpdateHeader
from ddiloco.run.prepare import prepare
from ddiloco.store.url import open_store
from ddiloco.syncer.loop import Syncer
from ddiloco.syncer.rounds import Answer, link_time
from tests._harness import drive, status, tiny_config

STEP = 0.010  # the learners' median wall seconds per step


def syncer(name: str, *overrides: str) -> Syncer:
    store = open_store(f"memory://{name}")
    prepare(store, tiny_config(name, *overrides))
    s = Syncer.open(store)
    s.xi_step = lambda: STEP  # type: ignore[method-assign]
    return s


def overwritten_share(window_s: float, sync_every: int) -> float:
    """Share of a fragment's H steps a fast learner trains and loses while a round waits `window_s`."""
    return window_s / STEP / sync_every


@pytest.mark.parametrize("sync_every,fragments,tau", [(32, 4, 2), (32, 1, 1), (8, 8, 2), (128, 4, 2)])
def test_waiting_on_late_compute_costs_at_most_tau_over_h(sync_every, fragments, tau):
    """Fast links (no transport time), a straggler holding the round open: before, the window spanned τ rounds
    of H/P steps (a share τ/P: 50% at H = 32, P = 4, 100% at P = 1); now τ steps, the paper's τ/H."""
    s = syncer(
        f"grace-{sync_every}-{fragments}",
        f"diloco.sync_every={sync_every}",
        f"diloco.fragments={fragments}",
        f"diloco.overlap={tau}",
    )
    s.books.xi_quorum, s.books.xi_sync, s.books.xi_link = 0.0, 0.0, 0.0
    assert overwritten_share(s.grace_window(), sync_every) <= tau / sync_every + 1e-12
    assert s.grace_window() == pytest.approx(0.8 * tau * STEP)  # γ = 0.8 by default


def test_slow_links_extend_the_window_by_their_transport_time():
    """Behind 10 Mbit/s + 50 ms the answers need ~0.3 s to arrive and the first one makes the quorum after
    ~0.25 s: the window still covers the others (the paper's all-reduce waits for its slowest link too)."""
    s = syncer("grace-link", "diloco.sync_every=32", "diloco.fragments=4")
    s.books.xi_quorum, s.books.xi_sync, s.books.xi_link = 0.25, 0.02, 0.30
    assert s.grace_window() == pytest.approx(0.8 * (2 * STEP + 0.30 - 0.25 - 0.02))
    s.books.xi_link = 0.0  # the same timings without the link allowance: nothing would be waited for
    assert s.grace_window() == 0.0


def test_the_cap_bounds_the_transport_allowance_only():
    s = syncer("grace-cap", "diloco.grace.cap_seconds=0.05", "diloco.grace.gamma=1")
    s.books.xi_quorum, s.books.xi_sync, s.books.xi_link = 0.0, 0.0, 100.0
    assert s.grace_window() == pytest.approx(2 * STEP + 0.05)
    s.xi_step = lambda: 60.0  # type: ignore[method-assign]  # slow steps: τ steps are still waited for
    assert s.grace_window() == pytest.approx(2 * 60.0 + 0.05)
    s.books.xi_quorum = 1e6
    assert s.grace_window() == 0.0
    assert syncer("grace-off", "diloco.grace=null").grace_window() == 0.0


def answer(arrived: float | None, wait: object) -> Answer:
    return Answer(
        "0-0", UpdateHeader.from_json({**UpdateHeader().to_json(), "wait_s": wait}), None, arrived_s=arrived
    )


def test_link_time_is_the_rounds_largest_arrival_less_the_learners_own_wait():
    """The learner's wait (finishing a step, an answer in flight) is its clock's duration; the arrival is this
    syncer's: only durations are compared, never two machines' clocks."""
    assert link_time([answer(0.30, 0.05), answer(0.12, 0.10), answer(0.50, 0.45)]) == pytest.approx(0.25)
    assert link_time([answer(0.10, 0.50)]) == 0.0  # never negative
    assert link_time([answer(0.2, "x"), answer(0.2, -1), answer(0.2, True)]) == pytest.approx(0.2)  # junk: 0
    assert link_time([answer(None, 0.0)]) is None and link_time([]) is None


def test_learners_report_their_own_wait_and_merges_feed_the_link_ema():
    """In-process run: every answer carries `wait_s` (the learner's clock, from first seeing the round open),
    each merge feeds ξ_link, and a restarted syncer resumes it from its state."""
    store = open_store("memory://grace-run")
    prepare(store, tiny_config("grace-run"))
    s = Syncer.open(store, poll_s=0)
    learners = [Learner.open(store, i) for i in range(2)]
    headers: list[UpdateHeader] = []
    for learner in learners:
        upload = learner.exchange._upload
        learner.exchange._upload = lambda p, r, snap, h, rep, up=upload: (
            headers.append(h),
            up(p, r, snap, h, rep),
        )
        learner.start()
    drive(s, learners)
    assert headers and all(isinstance(h.wait_s, float) and 0 <= h.wait_s < 5 for h in headers)
    assert s.books.xi_link > 0
    assert Syncer.open(store).books.xi_link == pytest.approx(s.books.xi_link)


def test_the_poller_remembers_when_it_first_saw_each_open_round():
    store = open_store("memory://grace-poller")
    poller = StatusPoller(store, 0.05, threading.Event())
    store.put_json(keys.STATUS, status(open_rounds=[OpenRound(5, 1, 0.0)]).to_json())
    poller.poll_once()
    first = poller.first_seen[5]
    store.put_json(keys.STATUS, status(open_rounds=[OpenRound(5, 1, 0.0), OpenRound(6, 2, 0.0)]).to_json())
    poller.poll_once()
    assert poller.first_seen[5] == first and poller.first_seen[6] >= first
    store.put_json(keys.STATUS, status(open_rounds=[OpenRound(6, 2, 0.0)]).to_json())
    poller.poll_once()
    assert set(poller.first_seen) == {6}
