"""Every object a deterministic in-process run writes, to check that a restructure changed no stored byte.

    python tests/stored_bytes.py OUT.json                         # record this tree's objects
    python tests/stored_bytes.py OUT.json --against BEFORE.json   # and compare: exit 1 on a difference
    python tests/stored_bytes.py OUT.json --set diloco.codec=int4 --set diloco.download_codec=int8   # other codecs

The run is tests/integration/test_bad_inputs.py's deterministic run (one thread, the syncer on a fake clock):
prepare (config, tokenizer, shards, version 0), every publish, learner updates, statuses, round records, and a
learner checkpoint written at the end; every write is recorded in order, objects retention deletes included.
Each key's writes are compared in order (the order between keys follows thread timing). Tensor payloads are
compared by SHA-256; JSON documents and tensor headers field by field. A field that holds a
wall-clock reading (times, nonces, memory peaks, the signatures over them) differs between two runs of the same
tree: the run is made twice, in two processes, and such fields are recorded as "<varies>", matching anything on
the other side. Floats in JSON documents (norms, ratios) match to 1e-12 relative (the order of a reduction).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VARIES = "<varies>"
WALL_CLOCK = {"history", "wait_s", "bytes_up", "bytes_down"}
WALL_CLOCK_KEYS = ("syncer/lease/renewals/",)
"""Objects written on the wall clock (the lease's renewals): how many there are depends on the machine's load."""
"""Fields sampled on the wall clock (a report's history, an answer's wait) or sized by such a field's text."""


def canonical(key: str, data: bytes) -> Any:
    """A JSON object as its document; a tensor file as its header and its payload's digest; else a digest."""
    if key.endswith(".json"):
        return json.loads(data)
    if len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        if 8 + n <= len(data) and data[8:9] == b"{":
            header = json.loads(data[8 : 8 + n])
            meta = header.get("__metadata__", {})
            for k, v in meta.items():  # a JSON document kept as a metadata string: compared field by field
                if isinstance(v, str) and v.startswith("{"):
                    meta[k] = json.loads(v)
            return {"header": header, "payload_sha256": hashlib.sha256(data[8 + n :]).hexdigest()}
    return {"sha256": hashlib.sha256(data).hexdigest()}


def record(name: str, overrides: list[str]) -> list[tuple[str, Any]]:
    """(key, canonical object) for every write of one deterministic run, in order."""
    from ddiloco.store.memory import MemoryStore, reset_memory_stores
    from tests.integration.test_bad_inputs import run

    writes: list[tuple[str, Any]] = []
    put, create = MemoryStore._put_locked, MemoryStore._create

    def put_locked(self, full_key, data):
        writes.append((full_key, canonical(full_key, bytes(data))))
        return put(self, full_key, data)

    def create_(self, full_key, data, strict):
        done = create(self, full_key, data, strict)
        if done:
            writes.append((full_key, canonical(full_key, bytes(data))))
        return done

    reset_memory_stores()
    MemoryStore._put_locked, MemoryStore._create = put_locked, create_
    try:
        r = run(
            name, "train.heartbeat_every_s=1e9", *overrides
        )  # reports at start and end only: not on the wall clock
        r.learners[0]._checkpoint_async()  # the learners' pools are inline: written before this returns
    finally:
        MemoryStore._put_locked, MemoryStore._create = put, create
    return writes


def mask(a: Any, b: Any) -> Any:
    """`a` with every field that differs in `b` replaced by VARIES, and the fields sampled on the wall clock."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return {k: VARIES if k in WALL_CLOCK else mask(a[k], b[k]) for k in a}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [mask(x, y) for x, y in zip(a, b, strict=True)]
    same = a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)  # NaN is NaN
    return a if same else VARIES


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where `a` and `b` differ, VARIES on either side matching anything."""
    if a == VARIES or b == VARIES:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: fields {sorted(a.keys() ^ b.keys())}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [
            d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b or _close(a, b) else [f"{path}: {a!r} vs {b!r}"]


def _close(a: Any, b: Any) -> bool:
    """Two floats a report computed (norms, ratios): equal to the last bits a reduction's order moves, or NaN."""
    if not (isinstance(a, float) and isinstance(b, float)):
        return False
    return (a != a and b != b) or abs(a - b) <= 1e-12 * max(abs(a), abs(b))


def by_key(writes: list[tuple[str, Any]]) -> dict[str, list[Any]]:
    """Each key's writes, in order (the order between keys follows the threads' timing, not the protocol)."""
    out: dict[str, list[Any]] = {}
    for key, obj in writes:
        out.setdefault(key, []).append(obj)
    return out


def merged(first: dict[str, list[Any]], second: dict[str, list[Any]]) -> dict[str, Any]:
    """One recording from two runs: fields that differ marked VARIES; a key written a different number of
    times recorded as VARIES whole; objects written on the wall clock left out."""
    first, second = (
        {k: v for k, v in run.items() if not k.startswith(WALL_CLOCK_KEYS)} for run in (first, second)
    )
    if first.keys() != second.keys():
        raise SystemExit(
            f"two runs of this tree wrote different keys: {sorted(first.keys() ^ second.keys())}"
        )
    return {
        k: [mask(x, y) for x, y in zip(first[k], second[k], strict=True)]
        if len(first[k]) == len(second[k])
        else VARIES
        for k in first
    }


def compare(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Every difference between two recordings, VARIES matching anything."""
    if before.keys() != now.keys():
        return [
            f"keys only before: {sorted(before.keys() - now.keys())}, only now: {sorted(now.keys() - before.keys())}"
        ]
    found = []
    for k in sorted(before):
        a, b = before[k], now[k]
        if a == VARIES or b == VARIES:
            continue
        if len(a) != len(b):
            found.append(f"{k}: written {len(a)} times before, {len(b)} now")
            continue
        found += [
            f"{k} (write {i}){d}"
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y)
        ]
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--against")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a run config override"
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # one run in this process (its own pid)
        Path(args.out).write_text(json.dumps(record("bytes", args.set)))
        return 0
    runs = []
    for i in range(2):  # two processes: pids and other per-process values differ too, and are marked
        part = f"{args.out}.run{i}"
        subprocess.run(
            [sys.executable, __file__, part, "--one", *(f"--set={o}" for o in args.set)],
            check=True,
            stderr=subprocess.DEVNULL,
        )
        runs.append(by_key([(k, o) for k, o in json.loads(Path(part).read_text())]))
        Path(part).unlink()
    objects = merged(*runs)
    Path(args.out).write_text(json.dumps({"objects": objects}, indent=1, sort_keys=True))
    writes = sum(len(v) for v in runs[0].values())
    varies = json.dumps(objects).count(VARIES)
    print(
        f"{writes} writes of {len(objects)} keys recorded in {args.out} ({varies} wall-clock fields marked {VARIES})"
    )
    if not args.against:
        return 0
    found = compare(json.loads(Path(args.against).read_text())["objects"], objects)
    if found:
        print(f"DIFFERENT from {args.against}: {len(found)} differences", *found[:30], sep="\n  ")
        return 1
    print(f"identical to {args.against}: {len(objects)} keys, each written as often, same bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
