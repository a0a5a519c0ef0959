"""Where the input files of a corpus are: listing them, opening one as a byte stream, and fingerprinting it.

Design choices:
- A source is a local path (a file or a directory; `file://` URLs too) or a store prefix (`s3://`,
  `memory://`, anything `ddiloco.store.url.open_store` opens). It travels to worker processes as that
  string, and a file within it as its name (the path relative to the directory, or the key relative to
  the prefix): a unit of work is strings only.
- Local files are read as streams (never whole). The Store API has no ranged read, so a store object is
  read whole, one at a time, and at most `max_object_bytes` (default 1 GiB): that is the per-object memory
  bound of a worker reading a store; split larger objects (or copy them to a local directory).
- Files are taken by extension (`SUPPORTED`), sorted by name; hidden files and directories (a leading
  '.') and the `cache-*.arrow` files `datasets` writes beside a saved dataset are skipped.
- A file's fingerprint is the sha256 of its bytes, streamed in 1 MiB blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ddiloco.errors import CorpusError
from ddiloco.store.base import NotFound, ObjectTooLarge

SUPPORTED = (".txt", ".md", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".arrow")
"""Input file extensions: text (one document per file), JSON lines (one per line), Parquet, and the Arrow
files of a Hugging Face `datasets` directory written by `save_to_disk`."""
MAX_OBJECT_BYTES = 1 << 30
"""Largest store object read (whole) as one input file."""
_BLOCK = 1 << 20


@dataclasses.dataclass(frozen=True)
class InputFile:
    """One input file: its name within the source, and its size in bytes."""

    name: str
    size: int


def suffix_of(name: str) -> str | None:
    """The supported extension `name` ends with (the longest), or None."""
    found = [s for s in SUPPORTED if name.endswith(s)]
    return max(found, key=len) if found else None


def is_local(source: str) -> bool:
    return "://" not in source or source.startswith("file://")


def local_path(source: str) -> Path:
    path = source[len("file://") :] if source.startswith("file://") else source
    return Path(path).expanduser().resolve()


def _wanted(name: str) -> bool:
    parts = name.split("/")
    if any(p.startswith(".") for p in parts):
        return False
    if parts[-1].startswith("cache-") and parts[-1].endswith(".arrow"):
        return False
    return suffix_of(name) is not None


def list_inputs(source: str) -> list[InputFile]:
    """The supported files of `source`, sorted by name; CorpusError if there are none."""
    if is_local(source):
        path = local_path(source)
        if path.is_file():
            files = [InputFile(path.name, path.stat().st_size)] if suffix_of(path.name) else []
        elif path.is_dir():
            files = [
                InputFile(p.relative_to(path).as_posix(), p.stat().st_size)
                for p in path.rglob("*")
                if p.is_file() and _wanted(p.relative_to(path).as_posix())
            ]
        else:
            raise CorpusError(f"input {source!r} does not exist; pass a file, a directory or a store URL")
    else:
        from ddiloco.store.url import open_store

        files = [InputFile(k, n) for k, n in open_store(source).sizes().items() if _wanted(k)]
    if not files:
        raise CorpusError(
            f"input {source!r} holds no supported files ({', '.join(SUPPORTED)}); point --input at a file "
            "or prefix that has some"
        )
    return sorted(files, key=lambda f: f.name)


@contextmanager
def open_input(source: str, name: str, *, max_object_bytes: int = MAX_OBJECT_BYTES) -> Iterator[BinaryIO]:
    """File `name` of `source` as a binary stream (a store object: read whole, at most max_object_bytes)."""
    if is_local(source):
        path = local_path(source)
        path = path if path.is_file() else path / name
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below
        except OSError as e:
            raise CorpusError(
                f"{path}: cannot read ({e.strerror}); check that it exists and is readable"
            ) from e
        with f:
            yield f
        return
    from ddiloco.store.url import open_store

    store = open_store(source)
    try:
        data = store.get(name, max_bytes=max_object_bytes)
    except ObjectTooLarge as e:
        raise CorpusError(
            f"{store.url}/{name} is larger than {max_object_bytes} bytes (store objects are read whole); split "
            "it into smaller files or raise max_object_bytes"
        ) from e
    except NotFound as e:
        raise CorpusError(f"{store.url}/{name} disappeared while tokenizing; rerun on a stable input") from e
    yield io.BytesIO(data)


def where(source: str, name: str) -> str:
    """How messages name file `name` of `source`."""
    if is_local(source):
        path = local_path(source)
        return str(path if path.is_file() else path / name)
    return f"{source.rstrip('/')}/{name}"


def fingerprint(source: str, name: str, *, max_object_bytes: int = MAX_OBJECT_BYTES) -> str:
    """sha256 (hex) of the bytes of file `name` of `source`, streamed."""
    h = hashlib.sha256()
    with open_input(source, name, max_object_bytes=max_object_bytes) as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()
