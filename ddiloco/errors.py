"""Error classes shared across packages, kept apart so raising one never imports the module that checks it.

Design choices:
- A leaf module (imports nothing from ddiloco): `ddiloco.store.shaped`, `ddiloco.config.chaos_schedule` and the
  config modules all raise `ConfigError` without importing each other.
- `ConfigError` is a `ValueError`: the command line prints every ValueError as one line with exit code 2.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration problem; the message says which key and what to change."""


class CorpusError(ValueError):
    """A corpus that cannot be read or tokenized as given (`ddiloco.data.tokens`, `ddiloco.data.textcorpus`); the
    message names the file (and line or position) and says what to change."""


def require(ok: bool, msg: str) -> None:
    """ConfigError(msg) unless ok: a config section's checks."""
    if not ok:
        raise ConfigError(msg)


def choose(key: str, value: Any, choices: tuple[str, ...]) -> None:
    """ConfigError naming `key` unless value is one of `choices`."""
    require(value in choices, f"{key}={value!r}: choose one of {', '.join(choices)}")
