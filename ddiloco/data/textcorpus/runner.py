"""Running per-file functions inline or on a pool of spawned worker processes, with nothing but plain values
crossing the process boundary.

Design choices:
- `workers == 1` runs everything in the calling process (no pool, no spawn cost; the caller's own store
  and tokenizer objects are used, so `memory://` stores work). More workers: a `ProcessPoolExecutor` with
  the spawn context (no forked locks or threads), each call given strings and ints and returning a JSON
  string; an exception in a worker comes back as JSON too (its type name and one-line message) and is
  raised here as `CorpusError`, so nothing relies on pickling exception objects.
- Calls are submitted largest input first (better balance); results come back in submission-independent
  order, keyed by the caller's index. The first failure cancels what has not started and is raised.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from ddiloco.errors import CorpusError


def _call_json(fn_name: str, args_json: str) -> str:
    """Worker side: call `fn_name` of `ddiloco.data.textcorpus.unit`/`.inputs` with JSON args; JSON back."""
    from ddiloco.data.textcorpus import inputs, unit

    fn = {"tokenize_file": unit.tokenize_file, "fingerprint": inputs.fingerprint}[fn_name]
    args = json.loads(args_json)
    try:
        return json.dumps({"ok": fn(*args["args"], **args["kwargs"])})
    except Exception as e:  # sent back as one line: type and message
        message = " ".join(str(e).split())
        return json.dumps(
            {"error": message if isinstance(e, ValueError) else f"{type(e).__name__}: {message}"}
        )


class Runner:
    """Maps a named per-file function over argument lists, inline or on `workers` spawned processes."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise CorpusError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self._pool: cf.ProcessPoolExecutor | None = None

    def __enter__(self) -> Runner:
        if self.workers > 1:
            self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def map(
        self,
        fn_name: str,
        inline: Callable[..., Any],
        calls: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        *,
        order: Sequence[int] | None = None,
    ) -> list[Any]:
        """The result of each call (args, kwargs), in the calls' order. `inline` is used without a pool;
        `fn_name` names the same function for workers. `order`: submission order (indices)."""
        if self._pool is None:
            return [inline(*args, **kwargs) for args, kwargs in calls]
        results: list[Any] = [None] * len(calls)
        futures = {
            self._pool.submit(
                _call_json, fn_name, json.dumps({"args": calls[i][0], "kwargs": calls[i][1]})
            ): i
            for i in (order if order is not None else range(len(calls)))
        }
        try:
            for done in cf.as_completed(futures):
                reply = json.loads(done.result())
                if "error" in reply:
                    raise CorpusError(reply["error"])
                results[futures[done]] = reply["ok"]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        return results
