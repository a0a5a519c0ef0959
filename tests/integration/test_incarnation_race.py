"""Learner starts racing as real processes on a file store never share an incarnation number (the
write-once claim of `ddiloco.learner.io.next_incarnation`).

The processes are forked (Linux), not spawned: a spawned child spends seconds importing torch, which spreads
the starts over seconds; forked children are released together by a barrier, so their claims overlap."""

from __future__ import annotations

import multiprocessing

from ddiloco import keys
from ddiloco.learner.io import next_incarnation
from ddiloco.store.url import open_store


def _start(url: str, out, barrier) -> None:
    store = open_store(url)
    barrier.wait(timeout=30)
    out.put(next_incarnation(store, 2, 0.0))


def test_processes_racing_on_a_file_store_never_share_a_number(tmp_path):
    url = f"file://{tmp_path}/run"
    ctx = multiprocessing.get_context("fork")
    out, barrier = ctx.Queue(), ctx.Barrier(3)
    procs = [ctx.Process(target=_start, args=(url, out, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [0, 1, 2]
    assert len(open_store(url).list(keys.incarnation_claim_prefix(2))) == 3
