"""What this process has used: its peak resident memory, as the kernel counts it.

Design choices:
- Linux: `VmHWM` of /proc/self/status, the high-water mark of this process image's resident set. Not
  `getrusage(RUSAGE_SELF).ru_maxrss`: it survives exec, so a process started by a big parent (the local
  launcher after prepare, a pod's entry point) reports the parent's peak until it exceeds it itself.
- Elsewhere `ru_maxrss` (bytes on macOS); None where neither exists (Windows), so a report says "unknown"
  rather than 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

STATUS = Path("/proc/self/status")


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes (None where the platform does not say)."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024
