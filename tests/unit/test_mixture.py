"""Batches from several streamed corpora with weights (`ddiloco.data.tokens.mixture`): the n-th batch's source is
fixed by the seed, shares converge to the weights, a resumed loader continues exactly, and a cursor of
another mixture is refused."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from ddiloco.data.tokens.corpus import TokenCorpus
from ddiloco.data.tokens.mixture import MixtureLoader
from ddiloco.data.tokens.ranges import plan_ranges, slot_chunks
from ddiloco.data.tokens.stream import StreamLoader
from ddiloco.store.url import open_store


def _corpus(name: str, offset: int):
    store = open_store(f"memory://mix-{name}")
    for i in range(2):
        ids = (np.arange(3000) % 100 + offset).astype(np.uint16)  # each corpus its own id range
        buf = io.BytesIO()
        np.save(buf, ids)
        store.put(f"part-{i}.npy", buf.getvalue())
    manifest = TokenCorpus.open(store).manifest(digest="size-only")
    return store, manifest, plan_ranges(manifest, num_slots=2, chunk_tokens=500, seed=0)


CORPORA = {"text": _corpus("text", 0), "code": _corpus("code", 1000)}


def _mixture(weights=(0.7, 0.3), seed=5) -> MixtureLoader:
    loaders = [
        StreamLoader(store, manifest, slot_chunks(plan, 0), batch_size=2, seq_len=16, seed=seed)
        for store, manifest, plan in CORPORA.values()
    ]
    return MixtureLoader(loaders, list(CORPORA), list(weights), seed=seed)


def test_shares_follow_the_weights_and_each_batch_comes_from_one_source():
    mix = _mixture()
    for _ in range(400):
        x, _ = mix.next_batch()
        assert bool((x < 1000).all()) or bool((x >= 1000).all())
    share = mix.tokens_by_source["text"] / sum(mix.tokens_by_source.values())
    assert abs(share - 0.7) < 0.06, mix.tokens_by_source
    assert 0 < mix.epochs_read


def test_a_resumed_mixture_gives_the_batches_an_uninterrupted_one_gives():
    straight, first = _mixture(), _mixture()
    for _ in range(13):
        first.next_batch()
    cursor = first.state_dict()
    resumed = _mixture()
    resumed.load_state_dict(cursor)
    for _ in range(13):
        straight.next_batch()
    for _ in range(20):
        assert torch.equal(resumed.next_batch()[0], straight.next_batch()[0])
    assert resumed.tokens_by_source == straight.tokens_by_source


def test_a_cursor_of_another_mixture_is_refused():
    cursor = _mixture().state_dict()
    other = MixtureLoader(_mixture().loaders[:1], ["web"], [1.0], seed=5)
    with pytest.raises(ValueError, match="mixes"):
        other.load_state_dict(cursor)
    with pytest.raises(ValueError, match="not a mixture cursor"):
        _mixture().load_state_dict({"seed": 1, "epoch": 0, "index": 0})
    with pytest.raises(ValueError, match="positive"):
        MixtureLoader(_mixture().loaders, list(CORPORA), [1.0, 0.0], seed=5)
