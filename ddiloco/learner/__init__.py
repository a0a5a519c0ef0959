"""The learner: inner training loop, its I/O with the run root, DDP ranks, checkpoints."""
