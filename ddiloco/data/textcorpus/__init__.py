"""Text corpora in, pre-tokenized `.npy` token files out: streamed, in parallel, content-addressed, reused."""
