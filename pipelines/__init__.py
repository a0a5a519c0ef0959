"""Kubeflow pipeline definitions (`pretrain`, `smoke`), their compiled YAML (golden-tested), and the
`ddiloco pipeline compile|submit|schedule|runs` commands (`pipelines.cli`, kfp imported only when used)."""
