"""Documents out of one input file, streamed: text, JSON lines (plain, gzip, zstd), Parquet, Arrow.

A `.txt`/`.md` file is one document, read whole up to `MAX_DOCUMENT_BYTES`. A `.jsonl` file is read line by
line (a string field, `text` by default); a bad line is an error naming file:line, never skipped, so a
corpus is never silently smaller than its files. `.jsonl.gz` streams through gzip, `.jsonl.zst` through
`zstandard` when installed. Parquet and the Arrow files of a `datasets.save_to_disk` directory are read
batch by batch with pyarrow, in bounded memory (`datasets` itself memory-maps every file, so it is not
used). Empty and whitespace-only documents and null cells are dropped. pyarrow is imported only for Parquet
and Arrow input (`pip install 'ddiloco[data]'`).

Design notes: docs/internals.md, "Input formats of `ddiloco tokenize`".
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any, BinaryIO

from ddiloco.data.textcorpus.inputs import suffix_of
from ddiloco.errors import CorpusError

MAX_DOCUMENT_BYTES = 256 << 20
"""Largest `.txt`/`.md` file (one document) read."""
_ARROW_ROWS = 1024


def iter_documents(stream: BinaryIO, where: str, field: str = "text") -> Iterator[str]:
    """The non-empty documents of the file at `where` (its name decides the format), read from `stream`."""
    suffix = suffix_of(where)
    if suffix in (".txt", ".md"):
        yield from _text(stream, where)
    elif suffix == ".jsonl":
        yield from _jsonl(stream, where, field)
    elif suffix == ".jsonl.gz":
        yield from _jsonl(gzip.GzipFile(fileobj=stream), where, field)
    elif suffix == ".jsonl.zst":
        yield from _jsonl(_zstd(stream, where), where, field)
    elif suffix == ".parquet":
        yield from _parquet(stream, where, field)
    elif suffix == ".arrow":
        yield from _arrow(stream, where, field)
    else:
        raise CorpusError(f"{where}: unsupported file type; rename or remove it")


def _text(stream: BinaryIO, where: str) -> Iterator[str]:
    data = stream.read(MAX_DOCUMENT_BYTES + 1)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise CorpusError(
            f"{where}: a text file is one document and this one exceeds {MAX_DOCUMENT_BYTES} bytes; split it "
            "into smaller files or convert it to JSON lines"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorpusError(
            f"{where}: not UTF-8 text (bad byte at offset {e.start}); convert it or remove it"
        ) from e
    if text.strip():
        yield text


def _jsonl(stream: Any, where: str, field: str) -> Iterator[str]:
    try:
        for lineno, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            text = _json_field(raw, f"{where}:{lineno}", field)
            if text.strip():
                yield text
    except (OSError, EOFError) as e:  # a truncated or corrupt gzip/zstd stream
        raise CorpusError(f"{where}: cannot read or decompress it ({e}); re-create the file") from e


def _json_field(raw: bytes, at: str, field: str) -> str:
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError as e:
        raise CorpusError(f"{at}: not UTF-8 (bad byte at offset {e.start}); convert the file") from e
    except json.JSONDecodeError as e:
        raise CorpusError(f"{at}: invalid JSON ({e.msg}); each line must be one JSON object") from e
    if not isinstance(obj, dict):
        raise CorpusError(
            f"{at}: expected a JSON object, got {type(obj).__name__}; each line must be one object"
        )
    if field not in obj:
        shown = sorted(obj)[:10]
        raise CorpusError(f"{at}: no field {field!r} (fields: {shown}); pass the text field with --field")
    value = obj[field]
    if not isinstance(value, str):
        raise CorpusError(f"{at}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _zstd(stream: BinaryIO, where: str) -> Any:
    try:
        import zstandard
    except ImportError:
        raise CorpusError(
            f"{where}: reading .jsonl.zst needs zstandard: pip install 'ddiloco[data]', or decompress it first"
        ) from None
    import io

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(stream))  # type: ignore[arg-type]


def pyarrow_modules() -> tuple[Any, Any, Any]:
    """(pyarrow, pyarrow.parquet, pyarrow.ipc), or CorpusError saying how to install them."""
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise CorpusError(
            "reading .parquet/.arrow files needs pyarrow: pip install 'ddiloco[data]'"
        ) from None
    return pyarrow, pyarrow.parquet, pyarrow.ipc


def _check_column(schema: Any, where: str, field: str) -> None:
    pa = pyarrow_modules()[0]
    if field not in schema.names:
        raise CorpusError(
            f"{where}: no column {field!r} (columns: {schema.names[:10]}); pass the text column with --field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise CorpusError(
            f"{where}: column {field!r} has type {kind}, not string; pass a text column with --field"
        )


def _column_texts(batch: Any, field: str) -> Iterator[str]:
    for text in batch.column(field).to_pylist():
        if text is not None and text.strip():
            yield text


def _parquet(stream: BinaryIO, where: str, field: str) -> Iterator[str]:
    pa, pq, _ = pyarrow_modules()
    try:
        pf = pq.ParquetFile(stream)
    except pa.ArrowException as e:
        raise CorpusError(f"{where}: not a readable Parquet file ({e}); re-create or remove it") from e
    _check_column(pf.schema_arrow, where, field)
    for batch in pf.iter_batches(batch_size=_ARROW_ROWS, columns=[field]):
        yield from _column_texts(batch, field)


def _arrow(stream: BinaryIO, where: str, field: str) -> Iterator[str]:
    pa, _, ipc = pyarrow_modules()
    try:
        reader = ipc.open_stream(stream)
        batches: Iterator[Any] = iter(reader)
    except pa.ArrowInvalid:
        stream.seek(0)
        try:
            file_reader = ipc.open_file(stream)
        except pa.ArrowException as e:
            raise CorpusError(f"{where}: not an Arrow stream or file ({e}); re-create or remove it") from e
        reader = file_reader
        batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
    _check_column(reader.schema, where, field)
    for batch in batches:
        yield from _column_texts(batch.select([field]), field)
