"""Shared test harness. Fixtures that start real servers live in their own modules and are imported here."""

import builtins
import os

import pytest

# Every process a test starts (and this one) trains with one thread: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests._cli import cli_run  # noqa: E402,F401
from tests._kfp_profile import profile_s3  # noqa: E402,F401
from tests._seaweed import s3_server  # noqa: E402,F401

_PRINT = builtins.print

# pytest-xdist (`-n auto`, pyproject): a test file's tests go to one worker, so its module fixtures run once;
# files that share a session fixture costing a run (tens of seconds) go to one worker together, so that run
# happens once too. (A scheduler of our own: xdist 3.8's `loadgroup` renames `item._nodeid`, which pytest 9.2
# no longer reads, and `loadfile` cannot put two files together.)
SHARED_RUN_FILES = {
    "tests/integration/test_report_browser.py": "tests/integration/test_posttrain.py",  # posttrained_runs
    "tests/integration/test_docs_commands.py": "tests/integration/test_cli_entry.py",  # cli_run
}


def scheduling_unit(nodeid: str) -> str:
    """The scheduling unit of a test: its file, or the file whose session run it shares."""
    path = nodeid.split("::", 1)[0]
    return SHARED_RUN_FILES.get(path, path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """End-to-end files (`slow`) first, in their order, then the rest: xdist hands out files as workers free
    up, and a long file handed out last would leave the other worker idle at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFileAndSharedRun(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return ByFileAndSharedRun(config, log)


@pytest.fixture(autouse=True)
def _restore_builtin_print():
    """kfp.local indents task output by swapping `builtins.print` (kfp/local/logging_utils.py,
    indented_print); tasks run on threads (tests/pipelines/test_kfp_local.py) restore it out of order and
    leave an indenting print behind, which broke a later test's output check (12 leading spaces)."""
    yield
    builtins.print = _PRINT


@pytest.fixture(autouse=True)
def _torch_threads():
    import torch

    torch.set_num_threads(1)
    yield
