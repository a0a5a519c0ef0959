"""The behaviour every Store backend must show, as plain functions of an empty store.

tests/unit/test_store.py runs them on memory:// and file://, tests/integration/test_s3_store.py on s3://.
Each function gets a fresh, empty store and must leave nothing behind that another one could see.
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable

import pytest

from ddiloco.store.base import NotFound, ObjectTooLarge, Store, StoreError
from ddiloco.store.blob import Blob

ContractCheck = Callable[[Store], None]


def put_get_roundtrip(store: Store) -> None:
    payload = os.urandom(3 * 1024 + 7)
    store.put("updates/0/3/learner-0-1", payload)
    assert store.get("updates/0/3/learner-0-1") == payload
    store.put("all-bytes", bytes(range(256)))
    assert store.get("all-bytes") == bytes(range(256))
    store.put("empty", b"")
    assert store.get("empty") == b""
    store.put("from-bytearray", bytearray(b"abc"))
    store.put("from-memoryview", memoryview(b"xyz"))
    assert store.get("from-bytearray") == b"abc" and store.get("from-memoryview") == b"xyz"
    with pytest.raises(TypeError):
        store.put("text", "not bytes")  # type: ignore[arg-type]


def pointer_overwrite(store: Store) -> None:
    for version in range(5):
        store.put_json("global/7/latest", {"version": version, "key": f"global/7/v{version}"})
        assert store.get_json("global/7/latest") == {"version": version, "key": f"global/7/v{version}"}
    store.put("global/7/latest", b"short")
    assert store.get("global/7/latest") == b"short"
    assert store.list("global/7") == ["global/7/latest"]


def json_roundtrip(store: Store) -> None:
    obj = {"run_id": "r-1", "names": ["α", "β"], "nested": {"x": 1.5, "ok": True, "none": None}}
    store.put_json("config.json", obj)
    assert store.get_json("config.json") == obj
    assert json.loads(store.get("config.json").decode("utf-8")) == obj
    assert store.get_json_or_none("config.json") == obj


def missing_keys(store: Store) -> None:
    with pytest.raises(NotFound):
        store.get("nope")
    with pytest.raises(NotFound):
        store.get("no/such/deep/key", max_bytes=10)
    with pytest.raises(NotFound):
        store.get_json("nope.json")
    assert store.get_or_none("nope") is None
    assert store.get_json_or_none("nope.json") is None
    store.put("dir/leaf", b"1")
    with pytest.raises(NotFound):
        store.get("dir")  # a prefix of other keys is not an object
    assert not store.exists("dir")


def exists_tracks_put_and_delete(store: Store) -> None:
    assert not store.exists("learners/3/heartbeat")
    store.put("learners/3/heartbeat", b"{}")
    assert store.exists("learners/3/heartbeat")
    store.delete("learners/3/heartbeat")
    assert not store.exists("learners/3/heartbeat")


def list_sorted_and_scoped(store: Store) -> None:
    keys = [
        "updates/3/12/l1-0",
        "updates/3/12/l0-0",
        "updates/3/2/l0-0",
        "updates/30/1/l0-0",
        "updates/3x",
        "global/3/v1",
        "done",
    ]
    for key in random.Random(0).sample(keys, len(keys)):
        store.put(key, key.encode())
    assert store.list() == sorted(keys)
    assert store.list("") == sorted(keys)
    under = ["updates/3/12/l0-0", "updates/3/12/l1-0", "updates/3/2/l0-0"]
    assert store.list("updates/3") == under  # whole segments: not updates/30 or updates/3x
    assert store.list("updates/3/") == under
    assert store.list("updates/3/12") == ["updates/3/12/l0-0", "updates/3/12/l1-0"]
    assert store.list("nothing/here") == []
    assert store.list("done") == []  # an object is not a prefix of itself


def sizes_match_the_objects(store: Store) -> None:
    """`sizes` lists what `list` lists, with each object's length (the run summary's `store_bytes`)."""
    objects = {"global/000/v00000001.safetensors": 1000, "global/000/latest.json": 17, "done": 0, "data/x": 3}
    for key, n in objects.items():
        store.put(key, os.urandom(n))
    assert store.sizes() == objects and list(store.sizes()) == store.list()
    assert store.sizes("global") == {k: n for k, n in objects.items() if k.startswith("global/")}
    assert store.sizes("nothing/here") == {}
    child = store.child("global")
    assert child.sizes() == {k[len("global/") :]: n for k, n in objects.items() if k.startswith("global/")}
    store.delete("data/x")
    assert "data/x" not in store.sizes()


def delete_is_idempotent(store: Store) -> None:
    store.delete("never/existed")
    store.put("a/b", b"1")
    store.delete("a/b")
    store.delete("a/b")
    assert store.list() == []
    store.put("a", b"2")  # the prefix a/ left by a/b does not block the key a
    assert store.get("a") == b"2"


def delete_prefix_counts(store: Store) -> None:
    for i in range(12):
        store.put(f"rounds/{i}/open", b"x")
    store.put("rounds-keep", b"k")
    store.put("syncer/state", b"s")
    assert store.delete_prefix("rounds") == 12
    assert store.list() == ["rounds-keep", "syncer/state"]
    assert store.delete_prefix("rounds") == 0
    assert store.delete_prefix("") == 2
    assert store.list() == []


def child_stores(store: Store) -> None:
    run = store.child("run-1")
    assert run.url == store.url + "/run-1"
    assert run.stats is store.stats
    run.put("config.json", b"{}")
    assert store.get("run-1/config.json") == b"{}"
    assert run.list() == ["config.json"]
    deep = run.child("learners/2/")
    deep.put("heartbeat", b"hb")
    assert deep.url == store.url + "/run-1/learners/2"
    assert run.list() == ["config.json", "learners/2/heartbeat"]
    assert store.list("run-1/learners") == ["run-1/learners/2/heartbeat"]
    assert deep.exists("heartbeat") and not deep.exists("config.json")
    store.put("run-10/other", b"o")
    assert run.list() == ["config.json", "learners/2/heartbeat"]  # run-10 is not inside run-1
    assert run.delete_prefix("") == 2
    assert store.list() == ["run-10/other"]
    with pytest.raises(ValueError):
        store.child("")
    with pytest.raises(ValueError):
        store.child("../escape")


def corrupt_json_names_key(store: Store) -> None:
    store.put("syncer/state.json", b'{"truncated": ')
    with pytest.raises(StoreError, match="syncer/state.json") as info:
        store.get_json("syncer/state.json")
    assert not isinstance(info.value, NotFound)
    store.put("binary.json", b"\xff\xfe\x00")
    with pytest.raises(StoreError, match="binary.json"):
        store.get_json_or_none("binary.json")


def max_bytes_enforced(store: Store) -> None:
    store.put("blob", b"x" * 100)
    assert store.get("blob", max_bytes=100) == b"x" * 100
    assert store.get("blob", max_bytes=1 << 30) == b"x" * 100
    with pytest.raises(ObjectTooLarge):
        store.get("blob", max_bytes=99)
    with pytest.raises(ObjectTooLarge):
        store.get_or_none("blob", max_bytes=10)
    store.put_json("big.json", {"pad": "y" * 2000})
    with pytest.raises(ObjectTooLarge):
        store.get_json("big.json", max_bytes=1000)
    assert store.get_json("big.json")["pad"] == "y" * 2000


BAD_KEYS = ["", "/abs", "a//b", "a/./b", "../up", "a/..", "trailing/", "sp ace", "star*", "ü", "a\\b", "q?x"]


def keys_are_validated(store: Store) -> None:
    for key in BAD_KEYS:
        with pytest.raises(ValueError):
            store.put(key, b"x")
        with pytest.raises(ValueError):
            store.get(key)
        with pytest.raises(ValueError):
            store.exists(key)
        with pytest.raises(ValueError):
            store.delete(key)
    for prefix in ["/abs", "a//b", "../x", "sp ace"]:
        with pytest.raises(ValueError):
            store.list(prefix)
    for key in ["A-z_0.9=x", "global/12/v0000003", "updates/0/1/learner-0-2.safetensors"]:
        store.put(key, b"ok")
        assert store.get(key) == b"ok"
    assert store.list() == sorted(["A-z_0.9=x", "global/12/v0000003", "updates/0/1/learner-0-2.safetensors"])


def stats_count_io(store: Store) -> None:
    before = store.stats.snapshot()
    store.put("s/one", b"0123456789")
    store.put("s/two", b"abc")
    store.get("s/one")
    store.get_or_none("s/missing")
    store.list("s")
    store.exists("s/one")
    store.delete("s/one")
    after = store.stats.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["puts"] == 2 and delta["bytes_written"] == 13
    assert delta["gets"] == 2 and delta["bytes_read"] == 10
    assert delta["lists"] == 1 and delta["heads"] == 1 and delta["deletes"] == 1
    assert set(after) >= {"bytes_written", "bytes_read", "puts", "gets", "lists", "retries"}


def create_is_write_once(store: Store) -> None:
    assert store.create("learners/0/incarnations/1", b"first") is True
    assert store.get("learners/0/incarnations/1") == b"first"
    assert store.list("learners/0") == ["learners/0/incarnations/1"]
    assert store.create("learners/0/incarnations/1", b"second, longer content") is False
    assert store.create("learners/0/incarnations/1", b"first") is False  # same bytes, no retry: still False
    assert store.get("learners/0/incarnations/1") == b"first"
    assert store.create("learners/0/incarnations/2", bytearray(b"")) is True  # empty objects too
    assert store.get("learners/0/incarnations/2") == b""
    store.put("pointer", b"put first")
    assert store.create("pointer", b"x") is False  # put objects count as taken
    assert store.get("pointer") == b"put first"
    store.delete("learners/0/incarnations/1")
    assert store.create("learners/0/incarnations/1", b"again") is True  # free again after a delete
    assert store.get("learners/0/incarnations/1") == b"again"
    child = store.child("run-1")
    assert child.create("lease", b"c") is True and child.create("lease", b"d") is False
    assert store.get("run-1/lease") == b"c"
    with pytest.raises(TypeError):
        store.create("text", "not bytes")  # type: ignore[arg-type]
    for key in ("", "../up", "a//b"):
        with pytest.raises(ValueError):
            store.create(key, b"x")


def create_json_roundtrip(store: Store) -> None:
    claim = {"learner": 3, "incarnation": 7, "host": "node-α", "nonce": "9f2c"}
    assert store.create_json("claims/3/7", claim) is True
    assert store.get_json("claims/3/7") == claim
    assert store.create_json("claims/3/7", {**claim, "nonce": "other"}) is False
    assert store.get_json("claims/3/7") == claim


def race_to_create(store: Store, key: str, contents: list[bytes]) -> list[bool]:
    """One thread per content, released together, each creating `key`; their results in order."""
    barrier = threading.Barrier(len(contents))
    results: list[bool | BaseException | None] = [None] * len(contents)

    def claim(i: int) -> None:
        try:
            barrier.wait(timeout=10)
            results[i] = store.create(key, contents[i])
        except BaseException as exc:  # pragma: no cover - reported below
            results[i] = exc

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(contents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(r, bool) for r in results), results
    return results  # type: ignore[return-value]


def create_race_has_exactly_one_winner(store: Store) -> None:
    """8 threads racing to create one key with different content: one True, and the object is its bytes.
    One round: SeaweedFS can hold a contended loser for 1-3 s (its object lock); more rounds of the
    local backends are in tests/unit/test_store_create.py."""
    contents = [f"claimant-{i}-".encode() * (i + 1) for i in range(8)]
    results = race_to_create(store, "race/0", contents)
    winners = [i for i, won in enumerate(results) if won]
    assert len(winners) == 1, results
    assert store.get("race/0") == contents[winners[0]]
    assert store.list("race") == ["race/0"]


def create_counts_in_stats(store: Store) -> None:
    before = store.stats.snapshot()
    assert store.create("c/one", b"12345") is True
    assert store.create("c/one", b"67") is False
    after = store.stats.snapshot()
    delta = {k: after[k] - before[k] for k in after}
    assert delta["creates"] == 2 and delta["create_conflicts"] == 1 and delta["bytes_written"] == 5


def blobs_are_written_as_their_parts_joined(store: Store) -> None:
    """A `Blob` (a header and borrowed buffers: how the syncer publishes) is stored as its parts joined, by
    put and by create, and `get_into` reads an object into lent memory, refusing one over max_bytes."""
    head, body = b"header:", memoryview(bytearray(os.urandom(70_001)))
    blob = Blob([head, body, b"", bytearray(b"tail")])
    joined = head + bytes(body) + b"tail"
    assert len(blob) == len(joined)
    store.put("blob/put", blob)
    assert store.get("blob/put") == joined
    assert store.create("blob/create", blob) and store.get("blob/create") == joined
    assert not store.create("blob/create", Blob([b"other"])) and store.get("blob/create") == joined
    lent: list[int] = []

    def lend(n: int) -> memoryview:
        lent.append(n)
        return memoryview(bytearray(n + 13))  # more than asked: only the object's bytes come back

    assert bytes(store.get_into("blob/put", lend)) == joined and lent[-1] >= len(joined)
    with pytest.raises(ObjectTooLarge):
        store.get_into("blob/put", lend, max_bytes=len(joined) - 1)
    with pytest.raises(NotFound):
        store.get_into("blob/absent", lend)
    with pytest.raises(TypeError):
        store.put("blob/text", ["not", "a", "blob"])  # type: ignore[arg-type]
    store.delete_prefix("blob")


def range_reads(store: Store) -> None:
    """`get_range` reads part of an object; past the end it gives what exists; `size` without reading."""
    payload = os.urandom(10_000)
    store.put("tokens/part-0.npy", payload)
    assert store.get_range("tokens/part-0.npy", 0, 10) == payload[:10]
    assert store.get_range("tokens/part-0.npy", 1234, 4321) == payload[1234:5555]
    assert store.get_range("tokens/part-0.npy", 9_990, 100) == payload[9_990:]  # short: the object ends
    assert store.get_range("tokens/part-0.npy", 10_000, 5) == b""  # at the end
    assert store.get_range("tokens/part-0.npy", 20_000, 5) == b""  # past it
    assert store.get_range("tokens/part-0.npy", 17, 0) == b""
    assert store.child("tokens").get_range("part-0.npy", 5, 3) == payload[5:8]
    assert store.size("tokens/part-0.npy") == 10_000 and store.child("tokens").size("part-0.npy") == 10_000
    store.put("empty", b"")
    assert store.get_range("empty", 0, 8) == b"" and store.size("empty") == 0
    for absent in ("tokens/absent.npy", "tokens"):  # a prefix of other keys is not an object either
        with pytest.raises(NotFound):
            store.get_range(absent, 0, 8)
        with pytest.raises(NotFound):
            store.get_range(absent, 0, 0)
        with pytest.raises(NotFound):
            store.size(absent)
    for offset, length in ((-1, 4), (0, -4)):
        with pytest.raises(ValueError):
            store.get_range("tokens/part-0.npy", offset, length)
    with pytest.raises(ValueError):
        store.get_range("../up", 0, 1)
    before = store.stats.snapshot()
    store.get_range("tokens/part-0.npy", 100, 50)
    after = store.stats.snapshot()
    assert after["gets"] - before["gets"] == 1 and after["bytes_read"] - before["bytes_read"] == 50
    store.delete_prefix("")


CONTRACT: list[ContractCheck] = [
    put_get_roundtrip,
    pointer_overwrite,
    json_roundtrip,
    missing_keys,
    exists_tracks_put_and_delete,
    list_sorted_and_scoped,
    sizes_match_the_objects,
    delete_is_idempotent,
    delete_prefix_counts,
    child_stores,
    corrupt_json_names_key,
    max_bytes_enforced,
    keys_are_validated,
    stats_count_io,
    create_is_write_once,
    create_json_roundtrip,
    create_race_has_exactly_one_winner,
    create_counts_in_stats,
    blobs_are_written_as_their_parts_joined,
    range_reads,
]
