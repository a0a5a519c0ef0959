"""The models learners train: the built-in GPT and Hugging Face causal LMs."""
