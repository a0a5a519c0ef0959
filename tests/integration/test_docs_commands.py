"""The commands README.md and docs/*.md tell a user to type: each shell block is run at a small size or its
commands are listed as skipped with the reason (the annotation before the block says which and how:
tests/_docs_commands.py). `pytest -k docs_commands` runs them all.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._docs_commands import DOCS, Block, DocsError, Sandbox, check_accounted, read_blocks, run_block


def _blocks() -> tuple[list[Block], str]:
    """Every shell block of the docs, or the first annotation that does not parse (failed below)."""
    try:
        return [block for path in DOCS for block in read_blocks(path)], ""
    except DocsError as e:
        return [], str(e)


BLOCKS, PARSE_ERROR = _blocks()
RUN = [b for b in BLOCKS if b.mode == "run"]
SKIPPED = [(b, cmd, why) for b in BLOCKS for cmd, why in b.skipped()]


def test_docs_commands_every_block_is_accounted_for():
    assert not PARSE_ERROR, PARSE_ERROR
    assert RUN, "no documented command runs"
    for block in BLOCKS:
        check_accounted(block)


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=[b.where for b in RUN])
def test_docs_commands(block: Block, tmp_path: Path, request: pytest.FixtureRequest):
    run_block(block, Sandbox.create(tmp_path, lambda: request.getfixturevalue("cli_run").root))


@pytest.mark.parametrize(
    ("block", "command", "reason"), SKIPPED, ids=[f"{b.where} {c[:40]}" for b, c, _ in SKIPPED]
)
def test_docs_commands_not_run(block: Block, command: str, reason: str):
    pytest.skip(f"{block.where} `{command}`: {reason}")


def _readme_copy(tmp_path: Path, old: str, new: str) -> Path:
    copy = tmp_path / "README.md"
    shutil.copy(DOCS[0], copy)
    text = copy.read_text()
    assert old in text
    copy.write_text(text.replace(old, new, 1))
    return copy


@pytest.mark.slow
def test_docs_commands_fail_on_a_broken_command_in_a_copy_of_the_readme(tmp_path: Path):
    """The blocks of the copy that differ from README.md are run: the broken one fails."""
    copy = _readme_copy(tmp_path, "--set 'chaos.events=[", "--set 'chaos.event=[")
    original = {b.text for b in read_blocks(DOCS[0])}
    changed = [b for b in read_blocks(copy) if b.text not in original]
    assert len(changed) == 1
    check_accounted(changed[0])
    with pytest.raises(
        DocsError, match=r"README.md:\d+: `.venv/bin/ddiloco run --set 'chaos.event=.*exited with 2"
    ):
        run_block(changed[0], Sandbox.create(tmp_path / "sandbox", lambda: tmp_path))


def test_docs_commands_fail_on_an_unannotated_block_in_a_copy_of_the_readme(tmp_path: Path):
    copy = _readme_copy(tmp_path, "## Tests\n", "## Tests\n\n```bash\nddiloco run --recipe paper-like\n```\n")
    unannotated = [b for b in read_blocks(copy) if not b.mode]
    assert [b.text for b in unannotated] == ["ddiloco run --recipe paper-like"]
    with pytest.raises(DocsError, match="shell block without a `<!-- docs-test"):
        check_accounted(unannotated[0])


def test_docs_commands_fail_on_a_directive_that_matches_nothing(tmp_path: Path):
    copy = _readme_copy(tmp_path, "  skip images/build.sh =>", "  skip images/buildx.sh =>")
    (block,) = [b for b in read_blocks(copy) if any(p == "images/buildx.sh" for _, p, _ in b.directives)]
    with pytest.raises(DocsError, match="`skip images/buildx.sh` matches no command"):
        check_accounted(block)
    untagged = _readme_copy(tmp_path, "<!-- docs-test: skip the whole", "<!-- docs-test: skipp the whole")
    with pytest.raises(DocsError, match="annotation must start"):
        read_blocks(untagged)
