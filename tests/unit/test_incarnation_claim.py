"""Two processes, one incarnation (issue 17 item 9): the incarnation number is claimed with a write-once
object, so two starts of the same learner racing each other get different numbers."""

from __future__ import annotations

import threading

import pytest

from ddiloco import keys
from ddiloco.learner.io import next_incarnation
from ddiloco.store.url import open_store
from ddiloco.store.wrapped import DelegatingStore


class BothReadFirst(DelegatingStore):
    """Holds every read of the incarnation pointer until two starts have read it: the interleaving in which
    a read-then-write claim gives both the same number."""

    def __init__(self, inner, parties: int = 2) -> None:
        super().__init__(inner)
        self.barrier = threading.Barrier(parties, timeout=10)

    def _get(self, full_key, max_bytes):
        try:
            return super()._get(full_key, max_bytes)
        finally:
            if full_key.endswith("incarnation.json"):
                self.barrier.wait()


@pytest.mark.parametrize("url", ["memory://inc-race", "file://{tmp}/run"])
def test_two_racing_starts_get_different_incarnations(url, tmp_path):
    store = open_store(url.format(tmp=tmp_path))
    for first in (None, 3):  # a new learner, and one whose pointer says 3
        if first is not None:
            store.put_json(keys.incarnation_key(7), {"incarnation": first})
        racing = BothReadFirst(store)
        got: list[int] = []

        def start(store=racing, got=got):
            got.append(next_incarnation(store, 7, 0.0))

        threads = [threading.Thread(target=start) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        base = 0 if first is None else first + 1
        assert sorted(got) == [base, base + 1], got
        for inc in got:
            assert store.get_json(keys.incarnation_claim_key(7, inc))["incarnation"] == inc
