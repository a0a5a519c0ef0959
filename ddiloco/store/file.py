"""Directory-backed store: `file:///abs/dir` (or a plain path). Several processes may share one directory.

A put writes a temporary file unique per process, thread and call and `os.replace`s it over the target, so
readers see the old object, the whole new one or nothing. A create hard-links the same complete temporary
file to the final name (`os.link` fails if anything is there), so of racing creators exactly one wins; a file
system without hard links raises AtomicCreateUnsupported. fsync is off by default: a write lost in a machine
crash is a learner dying before it wrote, which the protocol tolerates. Deleting a key prunes the directories
it leaves empty, as on S3. Transient errnos (EIO, ESTALE, EAGAIN, ...) are retried and end as
StoreUnavailable; EACCES and EROFS are StoreConfigError; any other OSError is StoreError.

Design notes: docs/internals.md, "Directories".
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ddiloco.store.base import (
    TEMP_NAME_RE,
    AtomicCreateUnsupported,
    NotFound,
    ObjectTooLarge,
    Store,
    StoreConfigError,
    StoreError,
    validate_key,
)
from ddiloco.store.blob import Data, Lend, parts_of
from ddiloco.store.retry import RetryPolicy, call_with_retry

logger = logging.getLogger(__name__)

__all__ = ["FileStore"]

T = TypeVar("T")

_TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ESTALE, errno.ETIMEDOUT, errno.ECONNRESET, errno.ENOLCK}
)
_RACE_ATTEMPTS = 8  # how often put re-creates a directory that a concurrent delete pruned
# os.link on a file system without hard links (FAT, some FUSE and SMB mounts)
_NO_LINK_ERRNOS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


class FileStore(Store):
    """A store in a local (or shared, e.g. NFS/PVC) directory."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        prefix: str = "",
        *,
        fsync: bool = False,
        retry: RetryPolicy | None = None,
    ) -> None:
        root_path = Path(root).expanduser().absolute()
        self._root = root_path
        self._fsync = fsync
        self._retry = retry if retry is not None else RetryPolicy()
        url = root_path.as_uri() + (f"/{prefix.strip('/')}" if prefix.strip("/") else "")
        super().__init__(url, prefix=prefix)
        self._io("create directory", root_path, lambda: root_path.mkdir(parents=True, exist_ok=True))

    @property
    def root(self) -> Path:
        """The backend directory (without this store's prefix)."""
        return self._root

    # ---- plumbing ----

    def _io(self, what: str, path: Path, fn: Callable[[], T]) -> T:
        """Run a file operation: retry transient errno, translate the rest into store errors."""

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            self.stats.add(retries=1)
            logger.warning("%s %s: %s; retry %d in %.2fs", what, path, exc, attempt, delay)

        try:
            return call_with_retry(
                fn, self._retry, is_transient=_is_transient, on_retry=on_retry, what=f"{what} {path}"
            )
        except OSError as exc:
            if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise StoreConfigError(
                    f"permission denied: cannot {what} {path} ({exc.strerror}); make the directory writable "
                    f"by this user or point --store elsewhere"
                ) from exc
            raise StoreError(f"cannot {what} {path}: {exc}") from exc

    def _path(self, full_key: str) -> Path:
        return self._root.joinpath(*full_key.split("/"))

    def _fsync_dir(self, directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ---- raw operations ----

    def _put(self, full_key: str, data: Data) -> None:
        path = self._path(full_key)
        self._io("write", path, lambda: self._put_once(full_key, path, data))

    def _put_once(self, full_key: str, path: Path, data: Data) -> None:
        self._land("put", full_key, path, data, lambda tmp: self._replace(full_key, tmp, path) or True)

    def _create(self, full_key: str, data: Data, strict: bool) -> bool:
        path = self._path(full_key)
        attempts = 0

        def once() -> bool:
            nonlocal attempts
            attempts += 1
            return self._create_once(full_key, path, data)

        # A transient errno (NFS) may come after the link landed: a retry then finds the key taken.
        return self._io("create", path, once) or (attempts > 1 and self._holds(full_key, data))

    def _create_once(self, full_key: str, path: Path, data: Data) -> bool:
        return self._land("create", full_key, path, data, lambda tmp: self._link(full_key, tmp, path))

    def _land(
        self, op: str, full_key: str, path: Path, data: Data, install: Callable[[Path], bool | None]
    ) -> bool:
        """Write `data` to a temp file beside `path` and `install` it there: True (in place), False (the key
        was taken), None (the directory vanished meanwhile: try again). The temp file never stays behind
        (a replace or link has already moved or copied it)."""
        for _ in range(_RACE_ATTEMPTS):
            tmp = self._write_temp(op, full_key, path, data)
            if tmp is None:
                continue
            try:
                done = install(tmp)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if done is None:
                continue
            if done and self._fsync:
                self._fsync_dir(path.parent)
            return done
        raise StoreError(f"cannot {op} {self._where(full_key)}: its directory keeps disappearing")

    def _write_temp(self, op: str, full_key: str, path: Path, data: Data) -> Path | None:
        """Write `data` to a new temp file beside `path`, creating the directory; None when a concurrent
        delete pruned the directory meanwhile (the caller tries again)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            if self._parent_is_object(path):
                raise StoreError(f"cannot {op} {self._where(full_key)}: a parent of it is an object") from exc
            return None  # a concurrent delete pruned the directory while mkdir checked it
        tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            return None  # a concurrent delete pruned the directory between mkdir and open
        try:
            with os.fdopen(fd, "wb") as f:
                for part in parts_of(data):  # a Blob's buffers in order, never joined
                    f.write(part)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    def _parent_is_object(self, path: Path) -> bool:
        """True if some directory on the way from the root to `path` is a file (a key, not a prefix)."""
        for parent in path.parents:
            if parent == self._root or self._root not in parent.parents:
                return False
            if parent.is_file():
                return True
        return False

    def _replace(self, full_key: str, tmp: Path, path: Path) -> None:
        try:
            os.replace(tmp, path)
        except IsADirectoryError:
            # An empty directory left by a crashed writer or racing put: the key itself wins.
            try:
                os.rmdir(path)
            except OSError as exc:
                raise StoreError(f"cannot put {self._where(full_key)}: it is a prefix of other keys") from exc
            os.replace(tmp, path)

    def _link(self, full_key: str, tmp: Path, path: Path) -> bool | None:
        """Hard-link the complete temp file to `path` unless something is there: True (linked), False (an
        object is there), None (an empty directory was in the way and is gone now: try again)."""
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno in _NO_LINK_ERRNOS:
                raise AtomicCreateUnsupported(
                    f"cannot create {self._where(full_key)}: the file system under {self._root} does not "
                    f"support hard links ({exc.strerror}), which atomic create needs; use a local disk or NFS"
                ) from exc
            raise
        if not path.is_dir():
            return False
        try:  # an empty directory left by a crashed writer or a racing put: the key itself wins, as in put
            os.rmdir(path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"cannot create {self._where(full_key)}: it is a prefix of other keys") from exc
        return None

    def _get(self, full_key: str, max_bytes: int | None) -> bytes:
        path = self._path(full_key)
        return self._io("read", path, lambda: bytes(self._read_once(full_key, path, max_bytes, None)))

    def _get_into(self, full_key: str, lend: Lend, max_bytes: int | None) -> memoryview:
        path = self._path(full_key)
        return self._io("read", path, lambda: memoryview(self._read_once(full_key, path, max_bytes, lend)))

    def _read_once(
        self, full_key: str, path: Path, max_bytes: int | None, lend: Lend | None
    ) -> bytes | memoryview:
        """The object's bytes, read whole, or into `lend(size)` when given (objects are replaced by rename:
        an open file keeps its size)."""
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed below; open errors are mapped first
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise NotFound(f"no object {self._where(full_key)}") from exc
        with f:
            size = os.fstat(f.fileno()).st_size
            if max_bytes is not None and size > max_bytes:
                raise ObjectTooLarge(
                    f"object {self._where(full_key)} has {size} bytes > max_bytes {max_bytes}"
                )
            if lend is None:
                return f.read()
            out, n = lend(size)[:size], 0
            while n < size and (got := f.readinto(out[n:])):
                n += got
            return out[:n]

    def _get_range(self, full_key: str, offset: int, length: int) -> bytes:
        path = self._path(full_key)
        return self._io("read", path, lambda: _read_range(path, self._where(full_key), offset, length))

    def _size(self, full_key: str) -> int:
        path = self._path(full_key)
        return self._io("stat", path, lambda: _file_size(path, self._where(full_key)))

    def _exists(self, full_key: str) -> bool:
        path = self._path(full_key)
        return self._io("stat", path, lambda: path.is_file())

    def _list(self, full_prefix: str) -> list[str]:
        base = self._path(full_prefix) if full_prefix else self._root
        return self._io("list", base, lambda: self._walk(base, full_prefix))

    def _walk(self, base: Path, full_prefix: str) -> list[str]:
        keys: list[str] = []
        stack = [(str(base), full_prefix)]
        while stack:
            directory, rel = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue  # absent prefix, a prefix that is an object, or pruned while we walked
            for entry in entries:
                if TEMP_NAME_RE.fullmatch(entry.name):
                    continue
                key = f"{rel}/{entry.name}" if rel else entry.name
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, key))
                        continue
                    if not entry.is_file():
                        continue
                except FileNotFoundError:
                    continue
                try:
                    validate_key(key)
                except ValueError:
                    logger.debug("ignoring %s: not a valid store key", entry.path)
                    continue
                keys.append(key)
        return keys

    def _sizes(self, full_prefix: str) -> dict[str, int]:
        out = {}
        for key in self._list(full_prefix):
            try:
                out[key] = os.stat(self._path(key)).st_size
            except FileNotFoundError:  # deleted since the listing
                continue
        return out

    def _delete(self, full_key: str) -> None:
        path = self._path(full_key)
        self._io("delete", path, lambda: self._delete_once(path))

    def _delete_once(self, path: Path) -> None:
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        directory = path.parent
        while directory != self._root and self._root in directory.parents:
            try:
                os.rmdir(directory)
            except OSError:
                break  # not empty (or already gone): stop pruning
            directory = directory.parent

    def check(self) -> None:
        if not os.access(self._root, os.W_OK | os.X_OK):
            raise StoreConfigError(
                f"store directory {self._root} is not writable: fix its permissions or point --store elsewhere"
            )

    def _where(self, full_key: str) -> str:
        return f"{self._root.as_uri()}/{full_key}"


def _read_range(path: Path, where: str, offset: int, length: int) -> bytes:
    """Up to `length` bytes of the file from `offset` (fewer where it ends); NotFound if it is no file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise NotFound(f"no object {where}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotFound(f"no object {where}")
        parts, n = [], 0
        while n < length and (part := os.pread(fd, length - n, offset + n)):  # a read may return less
            parts.append(part)
            n += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def _file_size(path: Path, where: str) -> int:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise NotFound(f"no object {where}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise NotFound(f"no object {where}")
    return st.st_size
