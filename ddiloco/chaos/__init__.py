"""Chaos: kill and restart learners on a schedule (local processes or Kubernetes pods)."""
