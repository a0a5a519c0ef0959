"""What a part that is saved and restored offers: `state_dict()` and `load_state_dict()` (torchtitan's `Stateful`).

Design choices:
- A part's state is a flat mapping of named fields; the syncer's state document (`SyncerState`) is the union
  of its parts' mappings, so each part names the fields it owns and no one lists them for it. The values are
  the document's typed messages (`ddiloco.protocol.messages`), not JSON: the document converts them.
- `load_state_dict` restores what `state_dict` returned (what a restart does on top, such as counting an
  incarnation, is the caller's; a figure of one process only, the pace's busy seconds, starts afresh); the
  mapping may hold other parts' fields, which a part ignores.
- `gather` refuses two parts that claim one field: a field has one owner.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def gather(parts: Iterable[Stateful]) -> dict[str, Any]:
    """The union of the parts' states; ValueError when two parts claim the same field."""
    out: dict[str, Any] = {}
    for part in parts:
        state = part.state_dict()
        if clash := out.keys() & state.keys():
            raise ValueError(f"{type(part).__name__} claims fields another part owns: {sorted(clash)}")
        out |= state
    return out


def restore(parts: Iterable[Stateful], state: Mapping[str, Any]) -> None:
    """Each part takes its fields from `state`."""
    for part in parts:
        part.load_state_dict(state)
