"""Kubeflow pipeline definitions (`pretrain`, `smoke`), their compiled YAML (golden-tested), and the
`ddiloco pipeline compile|submit|schedule|runs` commands (`ddiloco.pipelines.cli`, kfp imported only when used)."""
