"""The `ddiloco` command: the parser tree, dispatch, logging set-up and error handling.

The commands live in their own modules, each with a `register(subparsers)`: `run` (local end to end),
`roles` (`prepare`, `learner`, `syncer`, `summary`), `simulate`, `posttrain` (`evaluate`, `sft`, `report`),
`chaos`, `baseline`, `corpus`, `tokenize`, `logs`, and `ddiloco.pipelines.cli` (`pipeline
compile|submit|schedule`, kfp imported only when used). This module alone assembles the tree, so there are
no cycles. Errors a user can fix are one line on stderr with exit code 2 (`--debug` shows the traceback); a
CUDA out-of-memory error is one line saying what to change, exit code 1. The roles that run in pods ship
their log to the run root (`ddiloco.tracking.logship`). `--version` prints the installed version and,
in a checkout, its git commit.

Design notes: docs/internals.md, "The command line".
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from ddiloco.cli import baseline, chaos, corpus, keys, logs, posttrain, roles, run, simulate, tokenize
from ddiloco.cli.version import VersionAction
from ddiloco.errors import ConfigError
from ddiloco.pipelines import cli as pipeline
from ddiloco.store.base import StoreError
from ddiloco.tracking import logship

# The order of `ddiloco --help`.
COMMANDS = (run, roles, simulate, posttrain, chaos, pipeline, baseline, corpus, tokenize, logs, keys)

# Roles whose log goes to the run root (`ddiloco.tracking.logship`); learner and syncer bind once they know their
# incarnation, the others at once (the next free number).
SHIPPED_ROLES = ("learner", "syncer", "prepare", "evaluate", "sft", "chaos", "report")


class Parser(argparse.ArgumentParser):
    """Usage errors as one line that says where to look, like every other user-facing error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole `ddiloco` parser tree; each parsed command carries its handler in `args.func`."""
    parser = Parser(prog="ddiloco", description="Decoupled DiLoCo over object storage.")
    parser.add_argument("--version", action=VersionAction, help="show the version and git commit and exit")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def ship_logs(args: argparse.Namespace) -> logship.StoreLogHandler | None:
    """Install the run-root log handler for a shipped role (bound now unless it is a learner or syncer)."""
    if args.command not in SHIPPED_ROLES:
        return None
    handler = logship.install(args.command)
    url = getattr(args, "store", None) or (args.runs[0] if len(getattr(args, "runs", ())) == 1 else None)
    if handler is not None and url and args.command not in ("learner", "syncer"):
        handler.bind(url)
    return handler


def out_of_memory(e: BaseException) -> str:
    """One line for a CUDA out-of-memory error: torch's account of the device's memory and what to change."""
    said = " ".join(str(e).split()).split(" Of the allocated memory")[0].rstrip(".")
    return (
        f"{said}. Lower train.batch_size (sft.batch_size for SFT), or set train.activation_checkpointing=true, "
        "train.parallel=fsdp with more GPUs per learner, or a smaller model; learners that share a GPU "
        "(`ddiloco run` with more learners than GPUs) share its memory"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    ship = ship_logs(args)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, StoreError, OSError, TimeoutError, ValueError) as e:
        if args.debug:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if ship is not None:
            ship.note_exception()
        torch = sys.modules.get("torch")  # loaded by whatever ran out of GPU memory; not imported here
        if torch is not None and isinstance(e, torch.OutOfMemoryError) and not args.debug:
            print(f"error: {out_of_memory(e)}", file=sys.stderr)
            return 1  # a crash, restarted like one: the memory may have been another process's
        raise
    finally:
        if ship is not None:
            logship.uninstall(ship)


if __name__ == "__main__":
    sys.exit(main())
