"""Data: corpora, tokenizers, shards, token streams, and tokenizing text corpora."""
