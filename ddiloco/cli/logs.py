"""`ddiloco logs`: print the logs processes shipped to the run root (`ddiloco.tracking.logship`), or list them."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ddiloco import keys
from ddiloco.store.base import StoreError
from ddiloco.store.url import open_store
from ddiloco.tracking.logship import (
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_BYTES,
    ENDED,
    ENV_INTERVAL,
    ENV_KB,
    list_logs,
    read_log,
    text_lines,
    when,
    who,
)


def cmd_logs(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    entries = [
        (k, p)
        for k, p in list_logs(store)
        if (args.role is None or p[0] == args.role)
        and (args.id is None or p[1] == args.id)
        and (args.incarnation is None or p[2] == args.incarnation)
    ]
    filtered = args.role is not None or args.id is not None or args.incarnation is not None
    if not entries:
        if filtered:
            raise ValueError(f"no logs match in {store.url}; `ddiloco logs --store URL` lists the logs there")
        print(f"no logs in {store.url} (under {keys.LOGS})", file=sys.stderr)
        return 0
    if not filtered and args.tail is None:
        rows = [("KEY", "PROCESS", "LINES", "DROPPED", "LAST WRITE", "ENDED")]
        for key, p in entries:
            try:
                doc = read_log(store, key)
            except StoreError as e:
                rows.append((key, who(*p), "?", "?", "?", f"unreadable: {e}"))
                continue
            ended = ENDED.get(doc.get("exit"), str(doc.get("exit")))
            lines, dropped = str(len(text_lines(doc))), str(doc.get("dropped_lines", 0))
            rows.append((key, who(*p), lines, dropped, when(doc.get("time")), ended))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
        return 0
    for key, p in entries:  # by role, id and incarnation: the newest incarnation last
        try:
            doc = read_log(store, key)
        except StoreError as e:
            print(f"==> {key}: unreadable ({e}) <==")
            continue
        lines = text_lines(doc)
        dropped = f", {doc.get('dropped_lines', 0)} older dropped" if doc.get("dropped_lines") else ""
        ended = ENDED.get(doc.get("exit"), doc.get("exit"))
        print(
            f"==> {key}: {who(*p)}, pid {doc.get('pid')} on {doc.get('host')}, {len(lines)} lines{dropped}, "
            f"last write {when(doc.get('time'))}, {ended} <=="
        )
        for line in text_lines(doc, args.tail):
            print(line)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "logs",
        help="print the logs processes shipped to the run root (no filter: list them)",
        description=f"Each role ships its log to the run root (logs/ROLE/...) every ${ENV_INTERVAL} s "
        f"(default {DEFAULT_INTERVAL_S:g}), on exit and on SIGTERM: a ring of the last ${ENV_KB} KiB "
        f"(default {DEFAULT_MAX_BYTES >> 10}). Without --role/--id/--incarnation/--tail: a list of the logs; "
        "with them: the matching logs, the newest incarnation last.",
    )
    p.add_argument("--store", required=True, help="run root, e.g. file:///dir/run or s3://bucket/prefix/run")
    p.add_argument("--role", help="learner, syncer, prepare, evaluate, sft, chaos, report")
    p.add_argument("--id", type=int, help="learner id")
    p.add_argument(
        "--incarnation", type=int, help="only this incarnation (invocation number for other roles)"
    )
    p.add_argument("--tail", type=int, metavar="N", help="only the last N lines of each log")
    p.set_defaults(func=cmd_logs)
