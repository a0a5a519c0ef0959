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
