"""Pre-tokenized corpora (`.npy` token arrays in a directory or object-store prefix), streamed with bounded
memory: headers (`npy`), the corpus and its manifest (`corpus`), token ranges held out and assigned to
learners (`ranges`), resumable batches (`stream`, fetching through `readahead`) and validation batches
(`val`)."""
