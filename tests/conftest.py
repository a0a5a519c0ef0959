"""Shared test harness. Fixtures that start real servers live in their own modules and are imported here."""

import os

import pytest

# Every process a test starts (and this one) trains with one thread: the machine has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests._seaweed import s3_server  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _torch_threads():
    import torch

    torch.set_num_threads(1)
    yield
