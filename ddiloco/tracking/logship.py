"""Process logs shipped to the run's store, so a process that is killed (chaos, a deleted pod) leaves its log
behind: `logs/{role}/...` (`keys.log_key`), read back by `ddiloco logs` and shown in the run report.

A `logging.Handler` keeps formatted records in a ring bounded in bytes ($DDILOCO_LOG_SHIP_KB); `emit` does no
I/O, so logging never waits on the store. A daemon thread writes the whole ring every $DDILOCO_LOG_SHIP_S
seconds (default 5; 0 turns shipping off) if something changed, so a SIGKILLed process loses at most its
last interval. The first write claims the key with `Store.create`, so no process overwrites another's log.
On exit and on SIGTERM the ring is written one last time, and the signal is then handed on, so the process
still dies of it. The store is opened in the shipping thread: a role never waits on its log.

Design notes: docs/internals.md, "Logs in the store".
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping
from typing import Any

from ddiloco import keys
from ddiloco.store.base import AtomicCreateUnsupported, Store, StoreError
from ddiloco.store.url import open_store

log = logging.getLogger(__name__)

ENV_INTERVAL = "DDILOCO_LOG_SHIP_S"
ENV_KB = "DDILOCO_LOG_SHIP_KB"
DEFAULT_INTERVAL_S = 5.0
DEFAULT_MAX_BYTES = 1 << 20
FINAL_WRITE_S = 5.0
READ_MAX_BYTES = 64 << 20
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ENDED = {"exit": "exited", "error": "exited with an error", "SIGTERM": "SIGTERM", None: "running, or killed"}


class StoreLogHandler(logging.Handler):
    """The ring of one process's log and the thread that ships it; see the module docstring."""

    def __init__(
        self, role: str, *, max_bytes: int = DEFAULT_MAX_BYTES, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        super().__init__()
        keys.log_key(role, 0)  # a valid role name, or ValueError now rather than in the thread
        self.role, self.max_bytes, self.interval_s = role, max(256, int(max_bytes)), float(interval_s)
        self.started_at = time.time()
        self.key: str | None = None
        self.dropped_lines = self.dropped_bytes = self.failures = 0
        self._lines: deque[str] = deque()
        self._sizes: deque[int] = deque()
        self._bytes = self._seq = 0
        self._exit: str | None = None
        self._target: tuple[Store | str, int | None, int | None] | None = None
        self._store: Store | None = None
        self._shipped = (-1, False)  # (seq, final) of the newest object written
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._woken = False
        self._thread: threading.Thread | None = None
        self._generation = 0  # of shipping threads: one stopped by `finish` stays stopped after `resume`
        self._closed = False

    # --- taking records in (never blocks on I/O) ------------------------------------------------------------
    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.append(self.format(record))
        except Exception:
            self.handleError(record)

    def append(self, text: str) -> None:
        """Add one entry (a record: a traceback is one entry) to the ring; drop the oldest past max_bytes."""
        raw = text.encode("utf-8", "replace")
        cap = self.max_bytes // 4
        if len(raw) > cap:
            text = raw[:cap].decode("utf-8", "ignore") + f" [... {len(raw) - cap} bytes cut]"
            raw = text.encode("utf-8", "replace")
        with self.lock:  # type: ignore[union-attr]  # an RLock: emit already holds it
            self._lines.append(text)
            self._sizes.append(len(raw))
            self._bytes += len(raw)
            self._seq += 1
            while self._bytes > self.max_bytes:
                n = self._sizes.popleft()
                self._lines.popleft()
                self._bytes -= n
                self.dropped_lines += 1
                self.dropped_bytes += n
        if not self._woken and self._target is not None:
            self._woken = True  # nothing written yet: write the first lines now, once, not an interval later
            self._wake.set()

    def note_exception(self) -> None:
        """Put the exception being handled into the log (Python prints it to stderr itself), end: error."""
        self.append("".join(traceback.format_exc()).rstrip())
        self._exit = self._exit or "error"

    # --- shipping -------------------------------------------------------------------------------------------
    def bind(self, store: Store | str, ident: int | None = None, incarnation: int | None = None) -> None:
        """Ship to `store` (or a store URL, opened in the shipping thread) as this role's `ident` and
        `incarnation` (None: the next free number); starts the shipping thread. Earlier records are kept."""
        with self.lock:  # type: ignore[union-attr]
            self._target = (store, ident, incarnation)
        if self._thread is None and self.interval_s > 0 and not self._closed:
            self._thread = threading.Thread(
                target=self._loop, args=(self._generation,), name=f"logship-{self.role}", daemon=True
            )
            self._thread.start()

    def _loop(self, generation: int) -> None:
        # At once, and as soon as there is a first line: a process killed within its first interval leaves its
        # start behind. Then every interval.
        while not self._stop.is_set() and generation == self._generation:
            self.ship()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def _snapshot(self) -> tuple[int, dict[str, Any]] | None:
        with self.lock:  # type: ignore[union-attr]
            if self._target is None or not (self._lines or self.dropped_lines):
                return None
            _, ident, incarnation = self._target
            doc = {
                "role": self.role,
                "id": ident,
                "incarnation": incarnation,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started_at": self.started_at,
                "time": time.time(),
                "exit": self._exit,
                "max_bytes": self.max_bytes,
                "dropped_lines": self.dropped_lines,
                "dropped_bytes": self.dropped_bytes,
                "lines": list(self._lines),
            }
            return self._seq, doc

    def ship(self) -> bool:
        """Write the ring now if it changed since the last write; False if that failed (the ring is kept)."""
        snap = self._snapshot()
        return True if snap is None else self._write(*snap)

    def _write(self, seq: int, doc: dict[str, Any]) -> bool:
        # No lock but _write_lock is taken here: SIGTERM's final write runs in a thread of its own while the
        # main thread, which may hold the handler's lock, waits for it.
        final = doc["exit"] is not None
        with self._write_lock:
            if (seq, final) <= self._shipped:  # an older snapshot than the one written (or the same)
                return True
            try:
                store = self._open()
                if self.key is None:
                    self.key = self._claim(store, doc)
                    target, ident, _ = self._target  # type: ignore[misc]  # later writes name the number
                    self._target = (target, ident, doc["incarnation"])
                else:
                    store.put(self.key, json.dumps(doc, ensure_ascii=False).encode("utf-8"))
                self._shipped = (seq, final)
                self._woken = True  # written: from now on, every interval
                return True
            except Exception as e:  # the store is down, or anything else: keep the ring, try next time
                self.failures += 1
                error = e
        log.debug("log shipping of %s failed (%s: %s); retrying", self.role, type(error).__name__, error)
        return False

    def _open(self) -> Store:
        if self._store is None:
            target = self._target[0]  # type: ignore[index]
            self._store = open_store(target) if isinstance(target, str) else target
        return self._store

    def _claim(self, store: Store, doc: dict[str, Any]) -> str:
        _, ident, incarnation = self._target  # type: ignore[misc]
        own = incarnation is not None
        if not own:
            logs = [keys.parse_log_key(k) for k in store.list(f"{keys.LOGS}{self.role}/")]
            taken = [p[2] for p in logs if p is not None and p[1] == ident]
            incarnation = max(taken, default=-1) + 1
        for n in range(1000):
            doc["incarnation"] = incarnation + (0 if own else n)
            key = keys.log_key(self.role, doc["incarnation"], ident, n if own else 0)
            blob = json.dumps(doc, ensure_ascii=False).encode("utf-8")
            try:
                if store.create(key, blob):
                    return key
            except AtomicCreateUnsupported:  # a file system without hard links: claim racily
                if not store.exists(key):
                    store.put(key, blob)
                    return key
        raise StoreError(f"no free log key for {self.role} {ident} {incarnation}")

    def finish(self, reason: str, timeout: float = FINAL_WRITE_S) -> bool:
        """Stop the thread and write the ring one last time, marked `reason` (exit, SIGTERM), waiting at most
        `timeout` seconds for the store. True if written (or nothing to write)."""
        self._stop.set()
        self._wake.set()
        self._exit = self._exit or reason
        snap = self._snapshot()  # taken here: the thread that writes must not wait for a lock this one holds
        if snap is None or self.interval_s <= 0:
            return True
        ok = [False]
        writer = threading.Thread(target=lambda: ok.__setitem__(0, self._write(*snap)), daemon=True)
        writer.start()
        writer.join(timeout)
        return ok[0]

    def resume(self) -> None:
        """Ship again after `finish` (a SIGTERM that did not end the process)."""
        self._exit, self._thread = None, None
        self._generation += 1
        self._stop.clear()
        if self._target is not None:
            self.bind(*self._target)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.finish("exit")
        super().close()


# --- the process's handler ----------------------------------------------------------------------------------
_active: StoreLogHandler | None = None
_prev_sigterm: Any = None


def settings(env: Mapping[str, str] = os.environ) -> tuple[float, int]:
    """(interval seconds, ring bytes) from $DDILOCO_LOG_SHIP_S and $DDILOCO_LOG_SHIP_KB."""

    def number(name: str, default: float) -> float:
        raw = env.get(name, "").strip()
        try:
            value = float(raw) if raw else default
        except ValueError:
            value = -1.0
        if not (math.isfinite(value) and value >= 0):
            log.warning("%s=%r is not a number >= 0; using %g", name, raw, default)
            return default
        return value

    return number(ENV_INTERVAL, DEFAULT_INTERVAL_S), int(number(ENV_KB, DEFAULT_MAX_BYTES / 1024) * 1024)


def install(role: str, env: Mapping[str, str] = os.environ) -> StoreLogHandler | None:
    """Attach this process's handler to the root logger and handle SIGTERM (main thread only); it ships once
    `bind` says where. None when shipping is off ($DDILOCO_LOG_SHIP_S=0)."""
    global _active, _prev_sigterm
    interval, max_bytes = settings(env)
    if interval <= 0:
        return None
    if _active is not None:
        uninstall(_active)
    handler = StoreLogHandler(role, max_bytes=max_bytes, interval_s=interval)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    _active = handler
    if threading.current_thread() is threading.main_thread():
        prev = signal.getsignal(signal.SIGTERM)
        if prev is not signal.SIG_IGN:  # an ignored SIGTERM ends nothing, so there is nothing to flush for
            _prev_sigterm = prev
            signal.signal(signal.SIGTERM, _on_sigterm)
    return handler


def bind(store: Store | str, ident: int | None = None, incarnation: int | None = None) -> None:
    """Tell the installed handler (if any) where to ship; see `StoreLogHandler.bind`."""
    if _active is not None:
        _active.bind(store, ident, incarnation)


def uninstall(handler: StoreLogHandler) -> None:
    """Final write, detach, and give SIGTERM back to its previous handler."""
    global _active, _prev_sigterm
    handler.close()
    logging.getLogger().removeHandler(handler)
    if _active is handler:
        _active = None
        if signal.getsignal(signal.SIGTERM) is _on_sigterm and _prev_sigterm is not None:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, _prev_sigterm)
        _prev_sigterm = None


def _on_sigterm(signum: int, frame: Any) -> None:
    handler, prev = _active, _prev_sigterm
    if handler is not None:
        log.warning("%s: SIGTERM received; shipping the log, then exiting", handler.role)
        handler.finish("SIGTERM")
    signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
        return
    signal.raise_signal(signal.SIGTERM)  # the default action: die of SIGTERM, as without this handler
    # Still alive: the default action ignores SIGTERM here (PID 1 of a container), so the process runs on
    # until its SIGKILL, and so does its log.
    signal.signal(signal.SIGTERM, _on_sigterm)
    if handler is not None:
        handler.resume()


# --- reading ------------------------------------------------------------------------------------------------
def list_logs(store: Store) -> list[tuple[str, tuple[str, int | None, int, int]]]:
    """(key, (role, ident, incarnation, dup)) of every log in the run, by role, id, then incarnation."""
    found = [(k, p) for k in store.list(keys.LOGS) if (p := keys.parse_log_key(k)) is not None]
    return sorted(found, key=lambda kp: (kp[1][0], -1 if kp[1][1] is None else kp[1][1], *kp[1][2:]))


def read_log(store: Store, key: str) -> dict[str, Any]:
    doc = store.get_json(key, max_bytes=READ_MAX_BYTES)
    if not isinstance(doc, dict) or not isinstance(doc.get("lines"), list):
        raise StoreError(f"{store.url}/{key} is not a shipped log")
    return doc


def text_lines(doc: dict[str, Any], tail: int | None = None) -> list[str]:
    lines = "\n".join(str(x) for x in doc["lines"]).splitlines()
    return lines if tail is None else lines[-tail:] if tail > 0 else []


def who(role: str, ident: int | None, incarnation: int, dup: int) -> str:
    who = f"{role} {ident}" if ident is not None else role
    return f"{who} incarnation {incarnation}" + (f" (duplicate {dup})" if dup else "")


def when(t: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t))) if t else "-"


def died(
    store: Store, reports: list[dict[str, Any]], done: bool, *, tail: int = 20, limit: int = 20
) -> list[dict[str, Any]]:
    """The last `tail` lines of each process incarnation that died (at most `limit`, the newest ones): a
    learner incarnation without a final report once a newer one started or the run is done, or whose report
    says error; any process whose log says it ended by SIGTERM or an error; a syncer whose log was never
    closed once a newer one started or the run is done; another role's, once a newer one of its role started.
    """
    reports_by = {(r.get("learner_id"), r.get("incarnation")): r for r in reports}
    entries = list_logs(store)
    newest: dict[tuple[str, int | None], tuple[int, int]] = {}
    for _, (role, ident, inc, dup) in entries:
        newest[(role, ident)] = max(newest.get((role, ident), (-1, 0)), (inc, dup))
    out = []
    for key, (role, ident, inc, dup) in entries:
        over = (inc, dup) < newest[(role, ident)] or (done and role in ("learner", "syncer"))
        why = None
        if role == "learner" and not dup:
            rep = reports_by.get((ident, inc))
            if rep is not None and rep.get("final"):
                why = "exited with an error" if rep.get("exit_reason") == "error" else None
                if why is None:
                    continue
            elif over:
                why = "killed: no final report" if rep is not None else "killed before its first report"
        try:
            doc = read_log(store, key)
        except StoreError as e:
            log.warning("log %s unreadable: %s", key, e)
            continue
        end = doc.get("exit")
        if why is None:
            why = {"SIGTERM": "SIGTERM", "error": "exited with an error"}.get(end) or (
                "killed: its log was never closed" if end is None and over else None
            )
        elif end == "SIGTERM":
            why += " (SIGTERM)"
        elif end in ("exit", "error") and why.startswith("killed"):  # it ended, just without a final report
            why = "exited without a final report" if end == "exit" else "exited with an error"
        if why is not None:
            lines = text_lines(doc)
            out.append(
                {
                    "key": key,
                    "who": who(role, ident, inc, dup),
                    "why": why,
                    "time": doc.get("time"),
                    "lines": lines[-tail:],
                    "total_lines": len(lines),
                    "dropped_lines": doc.get("dropped_lines"),
                }
            )
    return sorted(out, key=lambda d: d["time"] or 0)[-limit:] if len(out) > limit else out
