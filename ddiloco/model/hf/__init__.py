"""Hugging Face causal LMs as the model being trained (`model.hf`): where the directory comes from
(`source`), the wrapper learners train (`model`), and building it for a run at prepare (`prepare`)."""
