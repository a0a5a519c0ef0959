"""Pre-tokenized `.npy` corpora (ddiloco.data.tokens): headers, bad files, manifest, ranges, streaming loader."""

from __future__ import annotations

import hashlib
import io
import itertools
import struct

import numpy as np
import pytest
import torch

from ddiloco.data.tokens.corpus import TokenCorpus
from ddiloco.data.tokens.npy import CorpusError, TokenFile
from ddiloco.data.tokens.ranges import cut_chunks, plan_ranges, slot_chunks
from ddiloco.data.tokens.stream import StreamLoader
from ddiloco.data.tokens.val import val_batches_from
from ddiloco.store.base import Store, StoreUnavailable
from ddiloco.store.memory import MemoryStore, reset_memory_stores
from ddiloco.store.shaped import Link, ShapedStore
from ddiloco.store.url import open_store
from ddiloco.store.wrapped import DelegatingStore


@pytest.fixture(autouse=True)
def _fresh_memory():
    reset_memory_stores()
    yield
    reset_memory_stores()


def npy_bytes(arr: np.ndarray, version: tuple[int, int] | None = None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version, allow_pickle=False)
    return buf.getvalue()


def corpus_store(sizes=(5000, 3000, 4100), dtype=np.uint16, seed: int = 0) -> tuple[Store, list[np.ndarray]]:
    store = MemoryStore("tokens")
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 60000, n).astype(dtype) for n in sizes]
    for i, a in enumerate(arrays):
        store.put(f"corpus/part-{i}.npy", npy_bytes(a))
    store.put("corpus/README.txt", b"not a token file")
    return store, arrays


def test_headers_of_numpy_save_files(tmp_path) -> None:
    (tmp_path / "c").mkdir()
    np.save(tmp_path / "c" / "a.npy", np.arange(1000, dtype=np.uint16))
    np.save(tmp_path / "c" / "b.npy", np.arange(70000, 70777, dtype=np.uint32))
    (tmp_path / "c" / "c.npy").write_bytes(npy_bytes(np.arange(5, dtype=np.uint16), version=(2, 0)))
    (tmp_path / "c" / "d.npy").write_bytes(npy_bytes(np.arange(6, dtype=np.uint32), version=(3, 0)))
    store = open_store(str(tmp_path))  # a plain directory is a file store
    corpus = TokenCorpus.open(store, "c")
    assert [(f.key, f.dtype, f.count) for f in corpus.files] == [
        ("c/a.npy", "uint16", 1000),
        ("c/b.npy", "uint32", 777),
        ("c/c.npy", "uint16", 5),
        ("c/d.npy", "uint32", 6),
    ]
    a = corpus.files[0]
    assert isinstance(a, TokenFile) and a.size_bytes == (tmp_path / "c" / "a.npy").stat().st_size
    assert a.size_bytes == a.data_offset + 2 * a.count and corpus.total_tokens == 1788


def _fortran_1d() -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<u2", "fortran_order": True, "shape": (10,)})
    return buf.getvalue() + bytes(20)


def _raw(header: str) -> bytes:
    text = header.encode("latin1")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


BAD_FILES = {
    "2-D": (npy_bytes(np.zeros((4, 5), np.uint16)), "1-D"),
    "float32": (
        npy_bytes(np.zeros(8, np.float32)),
        "holds float32 tokens; write token ids as uint16 or uint32",
    ),
    "int32": (npy_bytes(np.zeros(8, np.int32)), "holds int32 tokens"),
    "big-endian": (npy_bytes(np.zeros(8, ">u4")), "big-endian uint32.*little-endian"),
    "fortran": (_fortran_1d(), "Fortran order"),
    "truncated": (npy_bytes(np.zeros(100, np.uint16))[:-7], "is truncated.*100 uint16 tokens"),
    "trailing": (npy_bytes(np.zeros(10, np.uint16)) + b"xx", "trailing bytes"),
    "not-npy": (b"PK\x03\x04 a zip, not an array", "not a .npy file"),
    "object": (
        _raw("{'descr': '|O', 'fortran_order': False, 'shape': (3,), }") + bytes(24),
        "holds object tokens",
    ),
    "code": (_raw("__import__('os').system('echo hi')"), "unreadable .npy header"),
    "version": (b"\x93NUMPY\x04\x00" + bytes(64), "format version 4.0"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_token_files_are_corpus_errors_naming_the_file(name: str) -> None:
    data, match = BAD_FILES[name]
    store = MemoryStore("bad")
    store.put("corpus/good.npy", npy_bytes(np.arange(10, dtype=np.uint16)))
    store.put("corpus/part-3.npy", data)
    with pytest.raises(CorpusError, match=f"corpus/part-3.npy .*{match}") as info:
        TokenCorpus.open(store, "corpus")
    assert "\n" not in str(info.value)


def test_empty_prefix_says_what_to_write() -> None:
    store = MemoryStore("empty")
    store.put("other/part-0.npy", npy_bytes(np.arange(10, dtype=np.uint16)))
    store.put("corpus/notes.txt", b"x")
    with pytest.raises(CorpusError, match=r"no \.npy token files under memory://empty/corpus; .*numpy.save"):
        TokenCorpus.open(store, "corpus")


def test_check_vocab_names_the_file_and_the_first_bad_id() -> None:
    store, arrays = corpus_store(dtype=np.uint16)
    corpus = TokenCorpus.open(store, "corpus")
    assert corpus.check_vocab(60000, block_tokens=700) == sum(a.size for a in arrays)
    bad = np.arange(4000, dtype=np.uint32)
    bad[2500], bad[3000] = 70000, 80000
    store.put("corpus/part-1.npy", npy_bytes(bad))
    corpus = TokenCorpus.open(store, "corpus")
    with pytest.raises(
        CorpusError, match="corpus/part-1.npy holds token id 70000 at position 2500.*vocabulary size 65536"
    ):
        corpus.check_vocab(65536, block_tokens=1000)
    assert corpus.check_vocab(65536, sample=1000, block_tokens=500) == 3000  # [0, 500) and [3500, 4000)
    bad[3999] = 80000  # a sample always reads a file's first and last tokens
    store.put("corpus/part-1.npy", npy_bytes(bad))
    with pytest.raises(CorpusError, match="token id 80000 at position 3999"):
        TokenCorpus.open(store, "corpus").check_vocab(75000, sample=1000, block_tokens=100)


def test_manifest_digests_and_totals() -> None:
    store, arrays = corpus_store()
    corpus = TokenCorpus.open(store, "corpus")
    manifest = corpus.manifest()
    assert manifest["total_tokens"] == sum(a.size for a in arrays) and len(manifest["files"]) == 3
    first = manifest["files"][0]
    assert first["digest"] == "sha256:" + hashlib.sha256(store.get("corpus/part-0.npy")).hexdigest()
    assert {"key", "dtype", "count", "data_offset", "size_bytes"} <= first.keys()
    quick = corpus.manifest(digest="size-only")
    assert quick["files"][0]["digest"] == f"size:{first['size_bytes']}"


def _tokens_of(chunks, arrays) -> list[tuple[int, int]]:
    return [(f, t) for f, start, count in chunks for t in range(start, start + count)]


def test_ranges_are_disjoint_cover_the_corpus_and_hold_out_validation_first() -> None:
    store, arrays = corpus_store(sizes=(5000, 3000, 4100, 900))
    manifest = TokenCorpus.open(store, "corpus").manifest(digest="size-only")
    chunks = cut_chunks(manifest, 1000)
    assert [c for c in chunks if c[0] == 2] == [
        [2, 0, 1000],
        [2, 1000, 1000],
        [2, 2000, 1000],
        [2, 3000, 1000],
        [2, 4000, 100],
    ]
    plan = plan_ranges(manifest, num_slots=3, reserve=2, chunk_tokens=1000, val_tokens=2500, seed=5)
    assert plan == plan_ranges(manifest, num_slots=3, reserve=2, chunk_tokens=1000, val_tokens=2500, seed=5)
    assert plan["val_tokens"] >= 2500 and len({c[0] for c in plan["val"]}) >= 2  # spread over files
    again = plan_ranges(manifest, num_slots=1, chunk_tokens=1000, val_tokens=2500, seed=9)
    assert again["val"] == plan["val"]  # validation depends on neither the seed nor the learners
    parts = [plan["val"], *(slot_chunks(plan, i) for i in range(5))]
    assert len(plan["slots"]) == 5 and all(parts)
    flat = [t for p in parts for t in _tokens_of(p, arrays)]
    assert len(flat) == len(set(flat)) == sum(a.size for a in arrays)  # disjoint and covering
    with pytest.raises(CorpusError, match="learner id 5 has no token ranges.*larger reserve"):
        slot_chunks(plan, 5)
    with pytest.raises(CorpusError, match="leaves no training tokens"):
        plan_ranges(manifest, num_slots=1, chunk_tokens=1000, val_tokens=13000)


def _loader(store, manifest, chunks, **kw) -> StreamLoader:
    args = dict(batch_size=4, seq_len=16, seed=3, read_ahead=2) | kw
    return StreamLoader(store, manifest, chunks, **args)


def _plan(sizes=(5000, 3000, 4100), dtype=np.uint16):
    store, arrays = corpus_store(sizes=sizes, dtype=dtype)
    manifest = TokenCorpus.open(store, "corpus").manifest(digest="size-only")
    plan = plan_ranges(manifest, num_slots=2, chunk_tokens=512, val_tokens=1000, seed=1)
    return store, arrays, manifest, plan


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_loader_is_deterministic_and_reads_each_window_once_per_epoch(dtype) -> None:
    store, arrays, manifest, plan = _plan(dtype=dtype)
    chunks = slot_chunks(plan, 0)
    a, b = _loader(store, manifest, chunks), _loader(store, manifest, chunks)
    windows_per_epoch = sum((c[2] - 1) // 16 for c in chunks)
    seen = []
    with a, b:
        for _ in range(windows_per_epoch // 4):
            (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            assert xa.dtype == torch.int64 and xa.shape == (4, 16) and torch.equal(xa[:, 1:], ya[:, :-1])
            seen.extend(
                tuple(row) + (int(y),) for row, y in zip(xa.tolist(), ya[:, -1].tolist(), strict=True)
            )
        with _loader(store, manifest, chunks, seed=4) as other, _loader(store, manifest, chunks) as same:
            assert not torch.equal(other.next_batch()[0], same.next_batch()[0])
    expected = [
        tuple(int(t) for t in arrays[f][start + w * 16 : start + w * 16 + 17])
        for f, start, count in chunks
        for w in range((count - 1) // 16)
    ]
    assert sorted(seen) == sorted(expected)[: len(seen)] or sorted(seen) == sorted(expected)
    assert len(seen) > len(expected) - 4 and set(seen) <= set(expected) and len(set(seen)) == len(seen)


def test_resume_gives_the_batches_an_uninterrupted_loader_gives() -> None:
    store, _, manifest, plan = _plan()
    chunks = slot_chunks(plan, 1)
    kw = dict(batch_size=5, seq_len=64)  # 7 windows per chunk: the 30 batches run into a second epoch
    with _loader(store, manifest, chunks, **kw) as straight:
        reference = [straight.next_batch() for _ in range(30)]
        assert straight.epochs_read > 1
    with _loader(store, manifest, chunks, **kw) as first:
        for _ in range(7):
            first.next_batch()
        state = first.state_dict()
        consumed = first.tokens_consumed
    assert consumed == 7 * 5 * 64
    with _loader(store, manifest, chunks, **kw, seed=99) as resumed:  # the cursor carries the seed
        resumed.load_state_dict(state)
        assert resumed.tokens_consumed == consumed
        for want in reference[7:]:
            got = resumed.next_batch()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        resumed.load_state_dict(state)  # also while its read-ahead thread is running
        assert torch.equal(resumed.next_batch()[0], reference[7][0])


def test_progress_counters_and_shard_loader_interface() -> None:
    store, _, manifest, plan = _plan()
    chunks = slot_chunks(plan, 0)
    loader = _loader(store, manifest, chunks, batch_size=2)
    total = sum((c[2] - 1) // 16 for c in chunks)
    assert loader.tokens_per_batch == 32 and loader.epochs_read == 0.0 and loader.tokens_consumed == 0
    for _ in range(total // 2):
        loader.next_batch()
    assert loader.epochs_read == pytest.approx((total // 2 * 2) / total)
    while loader.epochs_read < 1:
        loader.next_batch()
    assert loader.state_dict()["epoch"] >= 1 and loader.tokens_consumed >= total * 16
    thread = loader._fetcher._thread
    loader.close()
    assert not thread.is_alive()
    dropped = _loader(store, manifest, chunks)
    dropped.next_batch()
    thread = dropped._fetcher._thread
    del dropped  # never closed: collecting the loader stops its thread
    thread.join(5)
    assert not thread.is_alive()


def test_loader_refuses_a_cursor_of_another_assignment() -> None:
    store, _, manifest, plan = _plan()
    with (
        _loader(store, manifest, slot_chunks(plan, 0)) as a,
        _loader(store, manifest, slot_chunks(plan, 1)) as b,
    ):
        a.next_batch()
        with pytest.raises(ValueError, match="another token assignment"):
            b.load_state_dict(a.state_dict())
        with pytest.raises(ValueError, match="seq_len"):
            _loader(store, manifest, slot_chunks(plan, 0), seq_len=8).load_state_dict(a.state_dict())
        with pytest.raises(ValueError, match="not written by StreamLoader"):
            a.load_state_dict({"seed": 1, "epoch": 0, "index": 3})  # a ShardLoader cursor


class CountingStore(DelegatingStore):
    """Counts range reads and checks, at each, that the loader holds at most read_ahead + 1 chunks."""

    def __init__(self, inner: Store, limit: int) -> None:
        super().__init__(inner)
        self.limit, self.reads, self.most, self.loader = limit, 0, 0, None
        self.fail_next = False

    def _get_range(self, full_key: str, offset: int, length: int) -> bytes:
        if self.fail_next:
            self.fail_next = False
            raise StoreUnavailable("injected")
        self.reads += 1
        # chunks fetched (this one included) minus chunks the consumer released: never above the limit
        self.most = max(self.most, self.reads - self.loader.chunks_released)
        assert self.reads - self.loader.chunks_released <= self.limit
        return super()._get_range(full_key, offset, length)


@pytest.mark.parametrize("read_ahead", [0, 1, 3])
def test_read_ahead_holds_at_most_read_ahead_plus_one_chunks(read_ahead: int) -> None:
    store, _, manifest, plan = _plan()
    counting = CountingStore(store, read_ahead + 1)
    chunks = slot_chunks(plan, 0)
    loader = _loader(counting, manifest, chunks, batch_size=8, read_ahead=read_ahead)
    counting.loader = loader
    for _ in range(60):  # more than one epoch of ~11 chunks
        loader.next_batch()
    assert loader.epochs_read > 1 and counting.reads >= len(chunks)
    assert counting.reads - loader.chunks_released <= read_ahead + 1
    loader.close()


def test_a_failed_fetch_is_raised_and_the_retried_call_gives_the_same_batch() -> None:
    store, _, manifest, plan = _plan()
    chunks = slot_chunks(plan, 0)
    with _loader(store, manifest, chunks) as straight:
        reference = [straight.next_batch()[0] for _ in range(40)]
    counting = CountingStore(store, 10**9)
    got, failures = [], 0
    with _loader(counting, manifest, chunks) as loader:
        counting.loader = loader
        got.append(loader.next_batch()[0])
        counting.fail_next = True  # the read-ahead's next fetch fails: a batch spanning two chunks needs it
        while len(got) < 40:
            try:
                got.append(loader.next_batch()[0])
            except StoreUnavailable:
                failures += 1
    assert failures == 1 and all(torch.equal(g, w) for g, w in zip(got, reference, strict=True))


def test_validation_batches_from_the_held_out_chunks() -> None:
    store, arrays, manifest, plan = _plan()
    batches = val_batches_from(store, manifest, plan["val"], batch_size=4, seq_len=16)
    x0, y0 = batches[0]
    f, start, _ = plan["val"][0]
    assert torch.equal(x0[0], torch.from_numpy(arrays[f][start : start + 16].astype(np.int64)))
    assert torch.equal(y0[1], torch.from_numpy(arrays[f][start + 17 : start + 33].astype(np.int64)))
    assert sum(x.shape[0] for x, _ in batches) == sum((c[2] - 1) // 16 for c in plan["val"])
    assert len(val_batches_from(store, manifest, plan["val"], batch_size=4, seq_len=16, max_batches=3)) == 3
    again = val_batches_from(store, manifest, plan["val"], batch_size=4, seq_len=16, max_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in itertools.zip_longest(again, batches[:3]))


def test_range_reads_through_a_shaped_link_are_priced_as_downloads() -> None:
    """A learner behind `link:` pays a round trip plus the range's bytes, not the object's."""
    store, _ = corpus_store()
    slept: list[float] = []
    shaped = ShapedStore(store, Link(bandwidth=None, latency=0.05), sleep=slept.append)
    assert shaped.get_range("corpus/part-0.npy", 128, 1000) == store.get("corpus/part-0.npy")[128:1128]
    assert sum(slept) == pytest.approx(0.1) and shaped.link_stats.snapshot()["bytes_down"] == 1000
    assert shaped.size("corpus/part-0.npy") == store.size("corpus/part-0.npy")
