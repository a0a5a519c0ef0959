"""Balanced tensor fragmentation: which parameter tensors travel and merge together.

Decoupled DiLoCo syncs the model one *fragment* at a time (round s merges fragment p = s mod P), so every
fragment should cost about the same to upload, merge and publish. Design choices:

- Whole tensors only. A fragment is a set of parameter names, never a slice of a tensor, so the wire format,
  the merge (RDA works per tensor) and checkpoints stay keyed by the model's own names.
- Longest-processing-time greedy (LPT): sort tensors by numel descending (ties by name), give each to the
  fragment with the smallest running total (ties to the lowest fragment_id). It is deterministic, so every
  learner and the syncer derive the same partition from the same model without talking to each other.
- Guarantee, precisely. Let ``ideal = total / P``. When a tensor ``t`` is placed, its fragment holds the
  minimum load, at most ``(total - t) / P``; so the largest fragment is at most ``ideal + (1 - 1/P) * t``
  where ``t`` is the *smallest* tensor in it. Hence:
    * every tensor <= ideal / 3 (the usual case: many layers, P modest)  ->  largest <= 4/3 * ideal;
    * a single tensor larger than ideal (a big token embedding at P = 24)  ->  that tensor is the
      floor, and it sits alone in its fragment, the rest balancing over the other fragments;
    * in general LPT is within (4/3 - 1/(3P)) of the *optimal* partition (Graham, 1969), and the optimum
      itself can exceed 4/3 * ideal when there are few, equal, chunky tensors (4 equal tensors on
      P = 3 fragments: 1.5 * ideal). ``imbalance`` reports the ratio actually reached.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["Fragment", "assignment", "imbalance", "partition"]


@dataclass(frozen=True, slots=True)
class Fragment:
    """One unit of synchronisation: a set of whole parameter tensors."""

    fragment_id: int
    """Position in ``range(P)``; the round-robin schedule visits fragments in this order."""
    names: tuple[str, ...]
    """Parameter names in this fragment, sorted, so iteration order is the same everywhere."""
    numel: int
    """Total number of elements: the fragment's share of upload, merge and publish cost."""


def partition(numels: Mapping[str, int], num_fragments: int) -> list[Fragment]:
    """Split parameter tensors into ``num_fragments`` balanced fragments (LPT greedy, deterministic).

    ``numels`` maps parameter name -> number of elements (``{n: p.numel() for n, p in
    model.named_parameters()}``). Every tensor lands in exactly one fragment and no fragment is empty.
    Raises ``ValueError`` with the setting to change when ``num_fragments`` cannot be honoured.
    """
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
