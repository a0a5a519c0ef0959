"""The workflow-controller's `workflowDefaults` a twin run is given (Argo controller.go setWorkflowDefaults:
strategic-merged under every Workflow, whose own fields win).

Design choices:
- `KFP_2_17` is the stock value Kubeflow Pipelines 2.17.0 installs: copied from
  manifests/kustomize/third-party/argo/base/workflow-controller-configmap-patch.yaml at tag 2.17.0 (a TTL, and
  `templateDefaults.retryStrategy {limit: '2', retryPolicy: OnError}` for every template).
- `None` (no workflowDefaults) is plain Argo: a retryStrategy without retryPolicy is OnFailure.
- `load_workflow_defaults(path)` reads ours (manifests/argo-retry/workflow-defaults.yaml, a ConfigMap whose
  `data.workflowDefaults` holds the YAML) or a bare workflowDefaults YAML file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

KFP_2_17_TEXT = """\
spec:
  ttlStrategy:
    secondsAfterCompletion: 3600
    secondsAfterSuccess: 3600
    secondsAfterFailure: 3600
  templateDefaults:
    retryStrategy:
      limit: '2'
      retryPolicy: OnError
"""
KFP_2_17: dict[str, Any] = yaml.safe_load(KFP_2_17_TEXT)


def load_workflow_defaults(source: str | Path) -> dict[str, Any]:
    """The parsed workflowDefaults of a ConfigMap manifest or of a workflowDefaults YAML document."""
    doc = yaml.safe_load(Path(source).read_text())
    if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
        text = (doc.get("data") or {}).get("workflowDefaults")
        if text is None:
            raise ValueError(f"{source}: the ConfigMap has no data.workflowDefaults")
        doc = yaml.safe_load(text)
    if not isinstance(doc, dict) or "spec" not in doc:
        raise ValueError(f"{source}: not a workflowDefaults document (no spec)")
    return doc
