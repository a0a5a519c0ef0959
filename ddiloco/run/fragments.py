"""Balanced fragmentation: which parameter tensors (or row ranges of them) travel and merge together.

Decoupled DiLoCo syncs the model one fragment at a time (round s merges fragment p = s mod P), so every
fragment should cost about the same to upload, merge and publish. Fragments hold whole tensors, keyed by
the model's own names; only a tensor larger than the ideal fragment (total / P) is split by rows into
pieces (`Piece`, named ``"{tensor}[{start}:{stop}]"``). Members are placed by the deterministic
longest-processing-time greedy rule, so every learner and the syncer derive the same partition without
talking, and the largest fragment stays within 4/3 of the ideal when every member is at most ideal / 3
(`imbalance` reports the ratio reached).

Design notes (piece sizes, per-piece RDA and its measured effect, the guarantee's proof):
docs/internals.md, "Balanced fragments".
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Fragment", "Piece", "assignment", "balanced", "imbalance", "partition", "split_rows"]


@dataclass(frozen=True, slots=True)
class Fragment:
    """One unit of synchronisation: a set of members (whole parameter tensors or row pieces of them)."""

    fragment_id: int
    """Position in ``range(P)``; the round-robin schedule visits fragments in this order."""
    names: tuple[str, ...]
    """Member names in this fragment (parameter names or piece names), sorted, so iteration order is the
    same everywhere."""
    numel: int
    """Total number of elements: the fragment's share of upload, merge and publish cost."""


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, stop)`` (dim 0) of parameter ``tensor``: a member of its own, merged on its own."""

    tensor: str
    """The parameter it is cut from."""
    start: int
    stop: int

    @property
    def name(self) -> str:
        """The member name: ``"{tensor}[{start}:{stop}]"``."""
        return f"{self.tensor}[{self.start}:{self.stop}]"


def split_rows(name: str, shape: Sequence[int], pieces: int) -> list[Piece]:
    """``name`` (of ``shape``) cut into ``pieces`` contiguous row ranges, the first ``rows % pieces`` one
    row longer (capped at one piece per row)."""
    rows = shape[0]
    k = max(1, min(pieces, rows))
    out, start = [], 0
    for i in range(k):
        stop = start + rows // k + (i < rows % k)
        out.append(Piece(name, start, stop))
        start = stop
    return out


def balanced(
    shapes: Mapping[str, Sequence[int]], num_fragments: int
) -> tuple[list[Fragment], dict[str, Piece]]:
    """The layout's partition: whole tensors (`partition`) unless one is larger than ideal, then with the
    large ones split into row pieces of at most ideal / 3 (see the module docstring). Returns the
    fragments (members: names of whole tensors and of pieces) and the pieces by member name.
    """
    numels = {n: math.prod(s) for n, s in shapes.items()}
    _check(numels, num_fragments)
    total, P = sum(numels.values()), num_fragments
    frags = _lpt(numels, P)
    pieces: dict[str, Piece] = {}
    # Integer thresholds: numel > ideal / d  <=>  d * numel * P > total.
    for divisor in (1, 3):
        if divisor == 3 and imbalance(frags) <= 4 / 3:
            break
        big = sorted(n for n, s in shapes.items() if len(s) > 0 and divisor * numels[n] * P > total)
        if not big:
            break
        row = {n: numels[n] // shapes[n][0] for n in big}
        pieces = {
            piece.name: piece
            for n in big
            for piece in split_rows(n, shapes[n], -(-3 * numels[n] * P // total))
        }
        members = {n: k for n, k in numels.items() if n not in row}
        members |= {name: (pc.stop - pc.start) * row[pc.tensor] for name, pc in pieces.items()}
        frags = _lpt(members, P)
    return frags, pieces


def partition(numels: Mapping[str, int], num_fragments: int) -> list[Fragment]:
    """Split parameter tensors into ``num_fragments`` balanced fragments (LPT greedy, deterministic).

    ``numels`` maps parameter name -> number of elements (``{n: p.numel() for n, p in
    model.named_parameters()}``). Every tensor lands in exactly one fragment and no fragment is empty.
    Raises ``ValueError`` with the setting to change when ``num_fragments`` cannot be honoured.
    """
    _check(numels, num_fragments)
    return _lpt(numels, num_fragments)


def _check(numels: Mapping[str, int], num_fragments: int) -> None:
    if isinstance(num_fragments, bool) or not isinstance(num_fragments, int):
        raise ValueError(f"diloco.fragments must be an integer, got {num_fragments!r}")
    n_tensors = len(numels)
    if n_tensors == 0:
        raise ValueError("cannot fragment a model without parameter tensors (numels is empty)")
    if num_fragments < 1:
        raise ValueError(f"diloco.fragments={num_fragments}; set diloco.fragments to at least 1")
    if num_fragments > n_tensors:
        raise ValueError(
            f"diloco.fragments={num_fragments} but the model has {n_tensors} parameter tensors; "
            f"set diloco.fragments <= {n_tensors} (fragments hold whole tensors, none may be empty)"
        )
    for name, n in numels.items():
        if not isinstance(name, str):
            raise ValueError(f"parameter names must be strings, got {name!r}")
        # A zero-size tensor would tie with an empty fragment and could leave one empty; a model never
        # has one as a trainable parameter, so reject it rather than special-case the greedy.
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(
                f"parameter {name!r} has numel={n!r}; every tensor needs a positive integer numel"
            )


def _lpt(numels: Mapping[str, int], num_fragments: int) -> list[Fragment]:
    order = sorted(numels.items(), key=lambda item: (-item[1], item[0]))
    # Min-heap keyed by (running total, fragment_id): pops the lightest fragment, ties to the lowest id.
    heap = [(0, fid) for fid in range(num_fragments)]
    members: list[list[str]] = [[] for _ in range(num_fragments)]
    for name, n in order:
        total, fid = heapq.heappop(heap)
        members[fid].append(name)
        heapq.heappush(heap, (total + n, fid))
    totals = {fid: total for total, fid in heap}
    return [Fragment(fid, tuple(sorted(members[fid])), totals[fid]) for fid in range(num_fragments)]


def assignment(fragments: Iterable[Fragment]) -> dict[str, int]:
    """Parameter name -> fragment_id, the lookup learners use to route a tensor to its fragment."""
    out: dict[str, int] = {}
    for frag in fragments:
        for name in frag.names:
            if name in out:
                raise ValueError(f"parameter {name!r} is in fragments {out[name]} and {frag.fragment_id}")
            out[name] = frag.fragment_id
    return out


def imbalance(fragments: Iterable[Fragment]) -> float:
    """Largest fragment's numel divided by the ideal ``total / P`` (1.0 = perfectly balanced)."""
    sizes = [frag.numel for frag in fragments]
    if not sizes:
        raise ValueError("imbalance of an empty list of fragments")
    total = sum(sizes)
    if total == 0:
        return 1.0
    return max(sizes) * len(sizes) / total
