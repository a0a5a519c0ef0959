"""Real rank processes for the DDP / FSDP tests: a free loopback port, and spawn-and-wait with a deadline
that kills what is left."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, timeout: float) -> None:
    """Run fn(rank, *args) in `nprocs` spawned processes; fail if they have not all ended by `timeout`."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "the ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
