"""`BufferPool` and the rounds that borrow from it: buffers come back and are reused, never while in use."""

from __future__ import annotations

import torch

from ddiloco.syncer.merge.accumulate import RoundSums
from ddiloco.syncer.merge.bufferpool import BufferPool


def test_a_given_back_buffer_is_reused_when_it_fits_and_the_pool_stays_bounded():
    pool = BufferPool(keep=2, slack=0.25)
    a = pool.take(1000)
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take(900)  # fits within the slack: the same memory
    assert b.data_ptr() == ptr and b.numel() == 900
    assert pool.take(100).data_ptr() != ptr  # too small a request for it: a fresh buffer
    pool.give(b)
    for n in (10, 20, 30):
        pool.give(torch.empty(n))
    assert len(pool._free) == 2 and pool._free[0].numel() == 1000  # the largest are kept


def test_rounds_zero_a_reused_buffer_and_recycle_the_merged_gradient():
    pool = BufferPool()
    shapes = {"w": (64, 8), "b": (8,), "e": (16, 4)}
    g = torch.Generator().manual_seed(0)

    def round_once():
        sums = RoundSums(shapes, method="rda", embedding_names={"e"}, pool=pool)
        answers = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(3)]
        for i, a in enumerate(answers):
            sums.add(str(i), 1.0, a)
        done = sums.finalize(lambda k: answers[int(k)])
        merged = {n: t.clone() for n, t in done.merged.items()}
        sums.recycle(done)
        sums.release()
        return merged

    round_once()
    first = dict(pool.__dict__)
    # a second round on recycled buffers that hold the first round's values gives the same as a fresh pool
    g2 = g.get_state()
    again = round_once()
    g.set_state(g2)
    fresh_pool, pool = pool, BufferPool()
    fresh = round_once()
    for n in shapes:
        assert torch.equal(again[n], fresh[n])
    assert fresh_pool.reused >= 2 and first["allocated"] == 2
