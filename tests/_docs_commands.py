"""The shell commands README.md and docs/*.md tell a user to type, read from the Markdown, and a runner for
them (tests/integration/test_docs_commands.py).

Every shell block (```bash, ```sh, ```shell, ```console, or an untagged block that starts with a command) is
preceded by an annotation, an HTML comment that does not show on the rendered page:

    <!-- docs-test: skip REASON -->           the block is not run; REASON is listed
    <!-- docs-test: run -->                   every command runs as written
    <!-- docs-test: run
      skip PREFIX => REASON                   commands starting with PREFIX are not run; REASON is listed
      sub OLD => NEW                          text replaced in every command (paths, placeholders)
      add PREFIX => ARGS                      ARGS appended to commands starting with PREFIX (the shrink)
      bg PREFIX                               runs in the background, waited for (exit 0) after the next command
      expect PREFIX => TEXT                   the command's stdout holds TEXT
    -->

A command is a line of the block (continued by a trailing backslash or an open quote), split at `&&`,
without its comment.
Commands run with bash, one after another, in a fresh directory whose `.venv/bin` (first on PATH) holds
this interpreter as `python` and the `ddiloco` console script, with exit code 0 required. In the annotation
`{tmp}` is that directory, `{tiny}` the `--set` overrides of a run of seconds (tests._cli.TINY_RUN_SETS) and
`{run}` the root of the shared finished tiny run (tests._cli.cli_run).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests._cli import ROOT, TINY_RUN_SETS, cli_env, entry_point

DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELL_TAGS = {"bash", "sh", "shell", "console", "zsh"}
COMMAND_START = re.compile(r"^(\$ |ddiloco\b|\.venv/|python|pip\b|kubectl\b|images/|export\b|docker\b)")
FENCE = re.compile(r"^\s*```(\S*)\s*$")
DIRECTIVE = re.compile(r"^(skip|sub|add|bg|expect)\s+(.+?)(?:\s+=>\s+(.*))?$")
TIMEOUT_S = 300


class DocsError(AssertionError):
    """A block that is not accounted for, an annotation that does not parse, or a command that failed."""


@dataclass(slots=True)
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    text: str
    mode: str = ""
    """run | skip | '' (no annotation)."""
    reason: str = ""
    directives: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def where(self) -> str:
        name = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name
        return f"{name}:{self.line}"

    def commands(self) -> list[str]:
        return split_commands(self.text)

    def skipped(self) -> list[tuple[str, str]]:
        """(command, reason) of the commands this block does not run."""
        if self.mode == "skip":
            return [(cmd, self.reason) for cmd in self.commands()]
        return [(cmd, why) for cmd in self.commands() if (why := self._skip_reason(cmd)) is not None]

    def _skip_reason(self, command: str) -> str | None:
        return next(
            (why for kind, prefix, why in self.directives if kind == "skip" and command.startswith(prefix)),
            None,
        )


def _scan(line: str, sep: str) -> tuple[list[str], str]:
    """`line` split at `sep` outside quotes, and the quote still open at its end ('' if none)."""
    parts, quote, start, i = [], "", 0, 0
    while i < len(line):
        c = line[i]
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return [*parts, line[start:i]], ""  # a comment, left out: its quotes are words
        elif line.startswith(sep, i):
            parts.append(line[start:i])
            start = i = i + len(sep)
            continue
        i += 1
    return [*parts, line[start:]], quote


def _split_outside_quotes(line: str, sep: str) -> list[str]:
    return _scan(line, sep)[0]


def split_commands(text: str) -> list[str]:
    """The commands of a block: logical lines (joined at a trailing backslash and inside quotes) split at
    `&&`."""
    logical, pending = [], ""
    for raw in text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.strip()[:-1].rstrip() + " "
        elif _scan(pending + raw.strip(), "&&")[1]:  # a quoted string goes on on the next line
            pending += raw.strip() + "\n"
        else:
            logical.append(pending + raw.strip())
            pending = ""
    commands = []
    for line in logical:
        if line and not line.startswith("#"):
            commands.extend(part.strip() for part in _split_outside_quotes(line, "&&") if part.strip())
    return commands


def _is_shell(tag: str, body: list[str]) -> bool:
    first = next((line.strip() for line in body if line.strip()), "")
    return tag in SHELL_TAGS or (tag == "" and bool(COMMAND_START.match(first)))


def _parse_annotation(comment: str, where: str) -> tuple[str, str, list[tuple[str, str, str]]]:
    lines = [line.strip() for line in comment.splitlines() if line.strip()]
    head = lines[0].removeprefix("docs-test:").strip()
    mode, _, rest = head.partition(" ")
    if mode == "skip":
        if not rest.strip() or len(lines) > 1:
            raise DocsError(f"{where}: `docs-test: skip` needs a reason on its line, and nothing else")
        return mode, rest.strip(), []
    if mode != "run" or rest.strip():
        raise DocsError(
            f"{where}: annotation must start `docs-test: run` or `docs-test: skip REASON`: {head!r}"
        )
    directives = []
    for line in lines[1:]:
        m = DIRECTIVE.match(line)
        needs_value = m is not None and m[1] != "bg"
        if m is None or needs_value != (m[3] is not None):
            raise DocsError(f"{where}: cannot read the directive {line!r} (see tests/_docs_commands.py)")
        directives.append((m[1], m[2], m[3] or ""))
    return mode, "", directives


def read_blocks(path: Path) -> list[Block]:
    """The shell blocks of a Markdown file with their annotations; DocsError for a dangling annotation."""
    lines = path.read_text().splitlines()
    blocks, i, pending = [], 0, None
    while i < len(lines):
        line = lines[i]
        if line.strip().startswith("<!-- docs-test:"):
            start = i
            while "-->" not in lines[i]:
                i += 1
            comment = "\n".join(lines[start : i + 1]).strip().removeprefix("<!--").removesuffix("-->")
            pending = (start + 1, comment.strip())
        elif (m := FENCE.match(line)) is not None:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            body = lines[i + 1 : end]
            if _is_shell(m[1], body):
                block = Block(path, i + 1, "\n".join(body))
                if pending is not None:
                    block.mode, block.reason, block.directives = _parse_annotation(pending[1], block.where)
                blocks.append(block)
            elif pending is not None:
                raise DocsError(
                    f"{path.name}:{pending[0]}: docs-test annotation before a block that is no shell block"
                )
            pending, i = None, end
        elif line.strip() and pending is not None:
            raise DocsError(f"{path.name}:{pending[0]}: docs-test annotation not right before a block")
        i += 1
    return blocks


def check_accounted(block: Block) -> None:
    """Every block annotated, every directive's prefix matching a command of its block."""
    if not block.mode:
        raise DocsError(
            f"{block.where}: shell block without a `<!-- docs-test: run|skip REASON -->` annotation "
            f"(tests/_docs_commands.py says how):\n{block.text}"
        )
    commands = block.commands()
    for kind, prefix, _ in block.directives:
        text = commands if kind != "sub" else [block.text]
        if not any((c.startswith(prefix) if kind != "sub" else prefix in c) for c in text):
            raise DocsError(f"{block.where}: `{kind} {prefix}` matches no command of the block")


@dataclass(slots=True)
class Sandbox:
    """The directory commands run in: `.venv/bin` with this interpreter and the `ddiloco` console script."""

    dir: Path
    run_root: Callable[[], Path]
    """The shared finished run's root, asked for only by a block that names `{run}`."""
    placeholders: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, dir: Path, run_root: Callable[[], Path]) -> Sandbox:
        bin_dir = dir / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "python").symlink_to(sys.executable)
        script = bin_dir / "ddiloco"
        script.write_text(f'#!/bin/sh\nexec {shlex.join(entry_point())} "$@"\n')
        script.chmod(0o755)
        return cls(dir, run_root, {"{tmp}": str(dir), "{tiny}": shlex.join(TINY_RUN_SETS)})

    def expand(self, text: str) -> str:
        if "{run}" in text:
            self.placeholders.setdefault("{run}", str(self.run_root()))
        for key, value in self.placeholders.items():
            text = text.replace(key, value)
        return text

    def env(self) -> dict[str, str]:
        env = cli_env()
        env["PATH"] = os.pathsep.join((str(self.dir / ".venv" / "bin"), env.get("PATH", "")))
        return env


def prepared(block: Block, sandbox: Sandbox) -> list[tuple[str, str, str]]:
    """(command as written, command to run, role) of the commands the block runs; role: fg | bg."""
    out = []
    for command in block.commands():
        if block._skip_reason(command) is not None:
            continue
        run = command
        for kind, old, new in block.directives:
            if kind == "sub":
                run = run.replace(old, sandbox.expand(new))
        for kind, prefix, args in block.directives:
            if kind == "add" and command.startswith(prefix):
                run = f"{run} {sandbox.expand(args)}"
        bg = any(kind == "bg" and command.startswith(prefix) for kind, prefix, _ in block.directives)
        out.append((command, sandbox.expand(run), "bg" if bg else "fg"))
    return out


def _failed(block: Block, command: str, code: int | None, stderr: str) -> DocsError:
    return DocsError(f"{block.where}: `{command}` exited with {code}:\n{stderr[-3000:]}")


@dataclass(slots=True)
class Started:
    """A command running with its output in files (a background command's output never fills a pipe)."""

    written: str
    proc: subprocess.Popen[bytes]
    out: Path

    @classmethod
    def start(cls, written: str, command: str, sandbox: Sandbox, n: int) -> Started:
        out = sandbox.dir / f".command-{n}"
        with open(f"{out}.out", "wb") as stdout, open(f"{out}.err", "wb") as stderr:
            proc = subprocess.Popen(
                ["bash", "-c", command], cwd=sandbox.dir, env=sandbox.env(), stdout=stdout, stderr=stderr
            )
        return cls(written, proc, out)

    def finish(self, where: str) -> str:
        """The command's stdout once it has exited 0; DocsError otherwise."""
        code = self.proc.wait(timeout=TIMEOUT_S)
        if code != 0:
            stderr = Path(f"{self.out}.err").read_text(errors="replace")
            raise DocsError(f"{where}: `{self.written}` exited with {code}:\n{stderr[-3000:]}")
        return Path(f"{self.out}.out").read_text(errors="replace")


def run_block(block: Block, sandbox: Sandbox) -> None:
    """Run the block's commands in order; DocsError on a non-zero exit or a missing promised output."""
    background: list[Started] = []
    try:
        for n, (written, command, role) in enumerate(prepared(block, sandbox)):
            started = Started.start(written, command, sandbox, n)
            if role == "bg":
                background.append(started)
                continue
            stdout = started.finish(block.where)
            for kind, prefix, text in block.directives:
                if kind == "expect" and written.startswith(prefix) and text not in stdout:
                    raise DocsError(f"{block.where}: `{written}` printed no {text!r}:\n{stdout[-3000:]}")
            while background:
                background.pop(0).finish(block.where)
        while background:
            background.pop(0).finish(block.where)
    finally:
        for started in background:
            started.proc.kill()
            started.proc.wait()
