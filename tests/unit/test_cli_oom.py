"""A CUDA out-of-memory error in any command is one line that says what to change (no GPU here: the learner
command raises torch's own exception with the message torch writes), exit code 1: a crash, restarted like
one by `ddiloco run` and the keeper, since the memory may have been another process's."""

from __future__ import annotations

import torch

from ddiloco.cli import main as cli
from ddiloco.cli import roles

TORCH_SAYS = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB "
    "is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory "
    "76.50 GiB is allocated by PyTorch, and 1.02 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html)"
)


def test_a_cuda_out_of_memory_error_is_one_line_that_says_what_to_change(monkeypatch, capsys):
    def learner(args):
        raise torch.OutOfMemoryError(TORCH_SAYS)

    monkeypatch.setattr(roles, "cmd_learner", learner)
    assert cli.main(["learner", "--store", "memory://oom", "--learner-id", "0"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"
    )
    assert "this process has 78.12 GiB memory in use. Lower train.batch_size" in line
    assert "train.parallel=fsdp" in line and "Traceback" not in line and "76.50 GiB" not in line
