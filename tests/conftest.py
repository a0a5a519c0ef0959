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

# Session fixtures that cost a run (tens of seconds): every test that uses one goes to the same pytest-xdist
# worker, so the run happens once; every other test goes with its module (module fixtures run once too).
SHARED_RUNS = ("posttrained_runs", "cli_run")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (`--dist loadgroup`, pyproject)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            shared = [name for name in SHARED_RUNS if name in getattr(item, "fixturenames", ())]
            item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.nodeid.split("::")[0]))


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
