"""How efficiently a learner trains: processed tokens/s, MFU, data-loader wait and peak memory.

Processed tokens/s are a step's tokens (all ranks) over the loop's wall seconds per step
(`ddiloco.protocol.chiptime.StepCadence`). MFU (PaLM appendix B, as nanoGPT's `estimate_mfu`) is model FLOPs per token
× processed tokens/s over the peak FLOP/s of the learner's devices, from `train.peak_flops` or the GPU's
data-sheet figure (`ddiloco.platform.peaks`); without either, MFU is omitted with one log line saying how to give it.
Data-loader wait is the time spent in `next_batch` (the summary's `data_wait_fraction`); peak memory is
CUDA's `max_memory_allocated` or the process's peak resident set (`ddiloco.platform.procinfo`). Every figure is a
plain scalar in the learner's report (`figures`) and a Prometheus metric.

Design notes: docs/internals.md, "Efficiency figures".
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ddiloco.platform import peaks
from ddiloco.platform.procinfo import peak_rss_bytes
from ddiloco.tracking.metrics import LearnerMetrics

__all__ = ["Efficiency", "device_peak", "matmul_precision"]

log = logging.getLogger(__name__)


def matmul_precision(precision: str, device: torch.device) -> str:
    """The `ddiloco.platform.peaks` precision of the inner step's matmuls: bf16 under bf16 autocast; fp32 tensors run
    as tf32 on CUDA when PyTorch allows it (`torch.backends.cuda.matmul.allow_tf32`), else as fp32."""
    if precision == "bf16":
        return "bf16"
    tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


def device_peak(device: torch.device, precision: str, override: float | None) -> peaks.Peak:
    """One device's peak FLOP/s: `override` (`train.peak_flops`) when given, else by the CUDA device's name."""
    if override is not None:
        return peaks.given(override)
    if device.type != "cuda":
        return peaks.Peak(None, f"no table entry for device type {device.type!r}")
    return peaks.lookup(torch.cuda.get_device_name(device), matmul_precision(precision, device))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


class Efficiency:
    """A learner incarnation's efficiency figures (module docstring); `metrics` are updated as they change."""

    def __init__(
        self,
        metrics: LearnerMetrics,
        *,
        flops_per_token: float,
        peak: peaks.Peak,
        devices: int,
        device: torch.device,
    ) -> None:
        """`peak`: one device's; `devices`: how many train this learner (its ranks)."""
        self.metrics, self.device, self.flops_per_token = metrics, device, flops_per_token
        self.peak_flops = None if peak.flops is None else peak.flops * devices
        self.peak_source = peak.source
        self.device_name = device_name(device)
        self.tokens_per_s: float | None = None
        self.mfu: float | None = None
        self.data_wait_seconds = 0.0
        if self.peak_flops is None:
            log.info(
                "MFU not reported: no peak FLOP/s for this learner's device %s (%s); give one device's peak at "
                "the training precision with train.peak_flops (e.g. --set train.peak_flops=312e12)",
                self.device_name,
                peak.source,
            )
        else:  # the MFU series exist only where the peak is known: absent, never a false 0
            self._mfu = metrics.mfu.labels(learner_id=metrics.learner_id)
            metrics.peak_flops.labels(learner_id=metrics.learner_id).set(self.peak_flops)

    @classmethod
    def of(
        cls, metrics: LearnerMetrics, model: Any, seq_len: int, device: torch.device, **how: Any
    ) -> Efficiency:
        """For `model` (the GPT or a Hugging Face model: its `flops_per_token`) trained at `seq_len` on
        `device`; `how`: `precision`, `peak_flops` (the override, or None) and `devices`."""
        peak = device_peak(device, how["precision"], how["peak_flops"])
        fpt = float(model.flops_per_token(seq_len))
        return cls(metrics, flops_per_token=fpt, peak=peak, devices=how["devices"], device=device)

    def waited(self, seconds: float) -> None:
        """A step waited `seconds` for its batch."""
        self.data_wait_seconds += seconds
        self.metrics.data_wait_seconds.inc(seconds)

    def stepped(self, tokens: int, step_seconds: float, per_step: float) -> None:
        """A step of `tokens` (all ranks) took `step_seconds` (batch wait included); the loop runs a step every
        `per_step` wall seconds (its cadence)."""
        m = self.metrics
        m.step_seconds.inc(step_seconds)
        self.tokens_per_s = tokens / per_step
        m.tokens_per_second.set(self.tokens_per_s)
        if self.peak_flops is not None:
            self.mfu = self.flops_per_token * self.tokens_per_s / self.peak_flops
            self._mfu.set(self.mfu)

    def peak_memory(self) -> tuple[int | None, str]:
        """(bytes, kind): the device's peak allocation on CUDA, the process's peak resident set on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device)), "cuda_max_allocated"
        return peak_rss_bytes(), "peak_rss"

    def figures(self) -> dict[str, Any]:
        """The report's efficiency fields (`ddiloco.protocol.learner_report.LearnerReport`), plain scalars."""
        memory, kind = self.peak_memory()
        if memory is not None:
            self.metrics.peak_memory.labels(learner_id=self.metrics.learner_id, kind=kind).set(memory)
        return {
            "tokens_per_s": self.tokens_per_s,
            "flops_per_token": self.flops_per_token,
            "peak_flops": self.peak_flops,
            "peak_flops_source": self.peak_source,
            "mfu": self.mfu,
            "device_name": self.device_name,
            "data_wait_seconds": self.data_wait_seconds,
            "peak_memory_bytes": memory,
            "peak_memory_kind": kind,
        }
