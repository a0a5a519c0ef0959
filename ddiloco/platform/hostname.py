"""How a learner or syncer names the host it runs on, in its reports and status (the chaos step's victim key).

Design choices:
- On Kubernetes the name is the pod's, from the downward API (`DDILOCO_POD_NAME` = `metadata.name`, set by
  the pipelines), never `socket.gethostname()`: the kubelet truncates a pod's hostname to 63 characters
  (kubernetes `pkg/kubelet/kubelet_pods.go`, truncatePodHostnameIfNeeded) and Argo v4's pod names for our
  tasks are 64-74 characters long, so every pod of a run would report the same string, which names no pod.
- Elsewhere (a laptop, `ddiloco run`) it is the machine's hostname, which the local chaos backend compares
  with its own.
"""

from __future__ import annotations

import os
import socket

POD_NAME_ENV = "DDILOCO_POD_NAME"


def host_name() -> str:
    """The pod's name where the pipeline exported it, else this machine's hostname."""
    return os.environ.get(POD_NAME_ENV, "").strip() or socket.gethostname()
