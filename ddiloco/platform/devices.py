"""The torch device a `device` setting names (`train.device`, `eval.device`, `sft.device`: auto, cpu, cuda)."""

from __future__ import annotations

import torch

from ddiloco.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """`auto`: the current CUDA device when there is one, else the CPU; `cuda`: the current CUDA device (a
    ConfigError when none is visible); `cpu`: the CPU; any other torch device spec (`cuda:1`) as it is."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for but no CUDA device is visible; use auto or cpu")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu" if name == "auto" else name)
