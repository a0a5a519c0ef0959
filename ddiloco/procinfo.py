"""What this process has used: its peak resident memory, as the kernel counts it.

Design choices:
- `getrusage(RUSAGE_SELF).ru_maxrss` (KiB on Linux, bytes on macOS): the high-water mark over the whole
  process life, the number an OOM kill is decided on, read without sampling. None where `resource` is
  missing (Windows), so a report says "unknown" rather than 0.
"""

from __future__ import annotations

import sys


def peak_rss_bytes() -> int | None:
    """This process's peak resident set size in bytes (None where the platform does not say)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024
