"""Peak FLOP/s of the devices learners train on, by device name and matmul precision: the MFU denominator.

Design choices:
- Dense tensor-core throughput from the vendors' data sheets (the figure *without* structured sparsity, which
  the data sheets mark with an asterisk and quote at twice the dense one). MFU (PaLM appendix B) divides the
  model's FLOPs per second by this peak, so a dense figure is the honest denominator.
- Looked up by a fragment of `torch.cuda.get_device_name()` (e.g. "NVIDIA H100 80GB HBM3" holds "H100"), most
  specific fragment first ("H100 PCIe" before "H100", "L40S" before "L40", "GH200" before "H200").
- The precision is that of the matmuls: `bf16` (autocast), `fp16`, `tf32` (fp32 tensors with
  `torch.backends.cuda.matmul.allow_tf32`) or `fp32` (CUDA cores; PyTorch's default for fp32 matmuls).
  A precision a device has no figure for (bf16 on a V100 or T4) is unknown, not guessed.
- Anything not in the table (CPUs, newer GPUs) has no peak: the learner then reports no MFU unless
  `train.peak_flops` gives one. Pure data and string matching: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("bf16", "fp16", "tf32", "fp32")

_T = 1e12


def _tensor(bf16: float, tf32: float, fp32: float) -> dict[str, float]:
    """Dense figures in TFLOP/s of a device with bf16 and tf32 tensor cores (fp16 runs at the bf16 rate)."""
    return {"bf16": bf16 * _T, "fp16": bf16 * _T, "tf32": tf32 * _T, "fp32": fp32 * _T}


# (name fragment, what the figures are, {precision: dense peak FLOP/s}); most specific fragment first.
# Sources (vendor data sheets; tensor-core figures there are "with sparsity", halved here):
# - H100 SXM / PCIe / NVL, H200 SXM / NVL: NVIDIA H100 Tensor Core GPU data sheet and NVIDIA H200 Tensor Core GPU
#   data sheet (FP32 67 / 51 / 60 TFLOPS; TF32 989 / 756 / 835 sparse; BF16 and FP16 1,979 / 1,513 / 1,671 sparse;
#   H200 SXM as H100 SXM, H200 NVL as H100 NVL). GH200: NVIDIA GH200 Grace Hopper data sheet (the H100 SXM figures).
# - A100 40GB and 80GB, SXM and PCIe: NVIDIA A100 Tensor Core GPU data sheet (FP32 19.5; TF32 156; BF16 / FP16
#   312; the same for every A100).
# - L40S: NVIDIA L40S data sheet (FP32 91.6; TF32 183 | 366*; BF16 / FP16 362.05 | 733*).
# - L40: NVIDIA L40 data sheet (FP32 90.5; TF32 90.5 | 181*; BF16 / FP16 181.05 | 362.1*).
# - L4: NVIDIA L4 Tensor Core GPU data sheet (FP32 30.3; TF32 120*; BF16 / FP16 242*).
# - A10: NVIDIA A10 Tensor Core GPU data sheet (FP32 31.2; TF32 62.5 | 125*; BF16 / FP16 125 | 250*).
#   A10G (AWS G5): NVIDIA publishes no data sheet of its own; the A10's figures (same GA102 class), give
#   `train.peak_flops` where a measured figure says otherwise.
# - V100: NVIDIA V100 Tensor Core GPU data sheet (SXM2: FP32 15.7, tensor FP16 125; PCIe: 14, 112;
#   V100S PCIe: 16.4, 130). No bf16 or tf32 hardware.
# - T4: NVIDIA T4 Tensor Core GPU data sheet (FP32 8.1, mixed-precision FP16 65). No bf16 or tf32 hardware.
PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("GH200", "GH200 (H100 SXM compute)", _tensor(989.5, 494.5, 67)),
    ("H200 NVL", "H200 NVL", _tensor(835.5, 417.5, 60)),
    ("H200", "H200 SXM", _tensor(989.5, 494.5, 67)),
    ("H100 PCIe", "H100 PCIe", _tensor(756.5, 378, 51)),
    ("H100 NVL", "H100 NVL", _tensor(835.5, 417.5, 60)),
    ("H100", "H100 SXM", _tensor(989.5, 494.5, 67)),
    ("A100", "A100", _tensor(312, 156, 19.5)),
    ("L40S", "L40S", _tensor(362.05, 183, 91.6)),
    ("L40", "L40", _tensor(181.05, 90.5, 90.5)),
    ("L4", "L4", _tensor(121, 60, 30.3)),
    ("A10G", "A10G (A10 data sheet)", _tensor(125, 62.5, 31.2)),
    ("A10", "A10", _tensor(125, 62.5, 31.2)),
    ("V100S", "V100S PCIe", {"fp16": 130 * _T, "fp32": 16.4 * _T}),
    ("V100-PCIE", "V100 PCIe", {"fp16": 112 * _T, "fp32": 14 * _T}),
    ("V100", "V100 SXM2", {"fp16": 125 * _T, "fp32": 15.7 * _T}),
    ("T4", "T4", {"fp16": 65 * _T, "fp32": 8.1 * _T}),
)


@dataclass(frozen=True, slots=True)
class Peak:
    """One device's peak FLOP/s (None: unknown) and where the figure comes from."""

    flops: float | None
    source: str


def lookup(device_name: str, precision: str) -> Peak:
    """The data-sheet peak of a device named `device_name` (as `torch.cuda.get_device_name` says it) for matmuls
    in `precision` (one of `PRECISIONS`); `flops` None when the device or its figure at that precision is not
    in `PEAKS`."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    name = device_name.upper()
    for fragment, what, peaks in PEAKS:
        if fragment.upper() in name:
            if precision in peaks:
                return Peak(peaks[precision], f"data sheet: {what} dense {precision}")
            return Peak(None, f"{what} has no {precision} figure")
    return Peak(None, f"{device_name!r} is not in ddiloco.platform.peaks.PEAKS")


def given(flops: float) -> Peak:
    """A peak the config states (`train.peak_flops`)."""
    return Peak(float(flops), "train.peak_flops")
