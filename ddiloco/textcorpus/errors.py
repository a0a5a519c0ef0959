"""The one error type of `ddiloco.textcorpus`: bad input a user can fix.

Design choices:
- A leaf module, so readers, units and the driver raise it without importing each other.
- A `ValueError`, so the command line prints it as one line with exit code 2; every message names the file
  (and line) or prefix at fault and says what to do.
"""

from __future__ import annotations


class CorpusError(ValueError):
    """Input that cannot be tokenized as given; the message says which file and what to change."""
