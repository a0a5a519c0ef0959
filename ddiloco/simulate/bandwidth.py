"""WAN bandwidth each site needs: data-parallel vs Decoupled DiLoCo (closed forms, no simulation needed).

Sites exchange through a ring all-reduce: each sends and receives 2(k-1)/k of the payload over its WAN link
and pays 2(k-1) latency hops. Data-parallel all-reduces its gradients every step, overlapped with the
backward pass (β = 2/3 of the step), so a target utilization U needs B = bits·f / (β·T + T·(1/U - 1) -
2(k-1)·ℓ). Decoupled DiLoCo's learners never wait, so the link must instead (a) deliver each fragment's round
within τ inner steps, B ≥ frag_bits·f / (τ·T - 2(k-1)·ℓ), and (b) sustain P fragments every H steps,
B ≥ Σ frag_bits·f / (H·T); the requirement is the larger. A payload's bits per value come from its codec
(`ddiloco.codec.registry`), block scales included: bf16 scales by default, fp32 for a run of this package.

The figures against the paper's: docs/simulate.md, "Bandwidth model".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ddiloco.codec import registry

logger = logging.getLogger(__name__)

DTYPES = registry.Names("upload")
"""The upload codecs' names (command-line choices, looked up when asked); `Network.bits_per_value` takes any
registered one."""
# Paper (5B parameters, 1 s step, 90% utilization), Gbit/s; key: (method, sites, dtype).
PAPER_BANDWIDTH: dict[tuple[str, int, str], float] = {
    ("dp", 2, "bf16"): 104.0,
    ("dp", 8, "bf16"): 198.0,
    ("decoupled", 2, "bf16"): 1.7,
    ("decoupled", 2, "int4"): 0.43,
    ("decoupled", 8, "int4"): 0.84,
}
PAPER_PARAMS, PAPER_STEP_SECONDS, PAPER_UTILIZATION = 5e9, 1.0, 0.9


@dataclass(kw_only=True, slots=True)
class Network:
    """The WAN and the compute overlap assumptions."""

    latency_ms: float = 5.0
    """One-way latency of one ring hop between neighbouring sites, milliseconds."""
    backward_fraction: float = 2.0 / 3.0
    """Share of a data-parallel step that gradient all-reduce can hide behind (the backward pass)."""
    scale_bits: float = 16.0
    """Bits of the absmax scale stored per quantization block (int8 / int4 / int2)."""
    block: int = 128
    """Values per quantization block."""

    def __post_init__(self) -> None:
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if not 0 <= self.backward_fraction <= 1:
            raise ValueError(f"backward_fraction must be in [0, 1], got {self.backward_fraction}")
        if self.block < 1 or self.scale_bits < 0:
            raise ValueError("block must be >= 1 and scale_bits >= 0")

    def bits_per_value(self, dtype: str) -> float:
        if dtype not in registry.names():
            raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(registry.names())}")
        codec = registry.get(dtype)
        return codec.bits + (self.scale_bits / self.block if codec.scaled else 0.0)


@dataclass(kw_only=True, slots=True)
class Workload:
    """What one learner (one site) trains and how Decoupled DiLoCo paces its fragments."""

    params: float
    """Model parameters."""
    step_seconds: float
    """Inner-step wall time, seconds."""
    fragments: int = 24
    """P: fragments the parameters are split into."""
    sync_every: int = 24
    """H: inner steps between two rounds of the same fragment (P fragments per H steps)."""
    overlap: float = 2.0
    """τ: inner steps a fragment's round may take before the learner should have the merged fragment."""
    fragment_values: tuple[float, ...] | None = None
    """Parameters per fragment, when measured (a run's summary); None: an even split of `params`."""

    def __post_init__(self) -> None:
        if not self.params > 0 or not self.step_seconds > 0:
            raise ValueError(f"params and step_seconds must be > 0, got {self.params}, {self.step_seconds}")
        if self.fragments < 1 or self.sync_every < 1 or not self.overlap > 0:
            raise ValueError("fragments and sync_every must be >= 1 and overlap > 0")
        if self.fragment_values is not None and len(self.fragment_values) != self.fragments:
            raise ValueError(
                f"{len(self.fragment_values)} fragment sizes given for {self.fragments} fragments"
            )

    @property
    def largest_fragment(self) -> float:
        return max(self.fragment_values) if self.fragment_values else self.params / self.fragments

    @property
    def total_fragment_values(self) -> float:
        return float(sum(self.fragment_values)) if self.fragment_values else self.params


@dataclass(frozen=True, slots=True)
class BandwidthRow:
    method: str
    sites: int
    dtype: str
    gbps: float
    """Per-site WAN bandwidth needed, Gbit/s (inf: unreachable, latency alone exceeds the window)."""
    utilization: float
    gbps_deadline: float | None = None
    gbps_sustained: float | None = None
    paper: float | None = None

    def to_dict(self) -> dict[str, object]:
        def num(x: float | None) -> float | None:
            return None if x is None or math.isinf(x) else float(f"{x:.5g}")

        return {
            "method": self.method,
            "sites": self.sites,
            "dtype": self.dtype,
            "gbps": num(self.gbps),
            "gbps_deadline": num(self.gbps_deadline),
            "gbps_sustained": num(self.gbps_sustained),
            "utilization": self.utilization,
            "paper": self.paper,
        }


def allreduce_factor(sites: int) -> float:
    """Share of the payload each site sends (and receives) over its WAN link in a ring all-reduce."""
    if sites < 1:
        raise ValueError(f"sites must be >= 1, got {sites}")
    return 2.0 * (sites - 1) / sites


def _gbps(bits: float, window: float) -> float:
    return math.inf if window <= 0 else bits / window / 1e9


def dp_gbps(
    params: float, step_seconds: float, sites: int, utilization: float, dtype: str, net: Network
) -> float:
    """Per-site bandwidth for data-parallel to reach `utilization` (gradients all-reduced every step)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if sites == 1:
        return 0.0
    bits = params * net.bits_per_value(dtype) * allreduce_factor(sites)
    hops = 2 * (sites - 1) * net.latency_ms / 1e3
    window = step_seconds * (net.backward_fraction + 1.0 / utilization - 1.0) - hops
    return _gbps(bits, window)


def decoupled_gbps(work: Workload, sites: int, dtype: str, net: Network) -> tuple[float, float]:
    """(deadline, sustained) per-site bandwidth for Decoupled DiLoCo; the requirement is their max."""
    if sites == 1:
        return 0.0, 0.0
    f, bpv = allreduce_factor(sites), net.bits_per_value(dtype)
    hops = 2 * (sites - 1) * net.latency_ms / 1e3
    deadline = _gbps(work.largest_fragment * bpv * f, work.overlap * work.step_seconds - hops)
    sustained = _gbps(work.total_fragment_values * bpv * f, work.sync_every * work.step_seconds)
    return deadline, sustained


def _is_paper_setting(work: Workload, utilization: float) -> bool:
    return (
        work.params == PAPER_PARAMS
        and work.step_seconds == PAPER_STEP_SECONDS
        and math.isclose(utilization, PAPER_UTILIZATION)
        and work.fragment_values is None
    )


def bandwidth_table(
    work: Workload,
    sites: list[int] | tuple[int, ...],
    dtypes: list[str] | tuple[str, ...],
    *,
    utilization: float = 0.9,
    dp_dtype: str = "bf16",
    net: Network | None = None,
) -> list[BandwidthRow]:
    """Rows for data-parallel (at `dp_dtype`) and Decoupled DiLoCo (each of `dtypes`) at each site count."""
    net = net or Network()
    paper = _is_paper_setting(work, utilization)
    rows = []
    for k in sites:
        gbps = dp_gbps(work.params, work.step_seconds, k, utilization, dp_dtype, net)
        ref = PAPER_BANDWIDTH.get(("dp", k, dp_dtype)) if paper else None
        rows.append(
            BandwidthRow(method="dp", sites=k, dtype=dp_dtype, gbps=gbps, utilization=utilization, paper=ref)
        )
        for dtype in dtypes:
            deadline, sustained = decoupled_gbps(work, k, dtype, net)
            ref = PAPER_BANDWIDTH.get(("decoupled", k, dtype)) if paper else None
            rows.append(
                BandwidthRow(
                    method="decoupled",
                    sites=k,
                    dtype=dtype,
                    gbps=max(deadline, sustained),
                    utilization=1.0,
                    gbps_deadline=deadline,
                    gbps_sustained=sustained,
                    paper=ref,
                )
            )
    return rows
