"""Loopback ports: one free for a server or a process group to bind (the launcher's metrics endpoints, the
rendezvous of a learner's data-parallel ranks and of the baseline's)."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on the loopback interface that nothing was bound to a moment ago (the OS's pick). It is
    free again when this returns: another process may take it first, so bind it soon."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])
