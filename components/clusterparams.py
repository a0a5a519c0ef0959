"""The run parameters that place pods (node selectors, tolerations, Kueue queue, pod settings), checked where they
are given and in a run's first step, not when a learner's driver or keeper first reads them.

Design choices:
- Each rule is the one the reader of the value applies later: KFP 2.17's driver decodes a node selector
  into a `map[string]string` and a toleration into a `v1.Toleration` (backend/src/v2/driver/k8s.go
  extendPodSpecPatch: `json.Unmarshal`, which refuses a non-string selector value but drops an unknown
  toleration field silently), the API server then refuses an operator or effect Kubernetes does not know
  (k8s.io/kubernetes pkg/apis/core/validation ValidateTolerations); `PodSettings.of` reads `kueue_queue` and
  `pod_settings` in the keepers. A dropped field is refused here with a did-you-mean: a misspelt `effect`
  would otherwise leave a toleration that tolerates every effect.
- Errors are `ConfigError`s naming the parameter and what to write.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from ddiloco.components.podsettings import PodSettings

from ddiloco.errors import ConfigError

TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")
OPERATORS = ("", "Exists", "Equal")
EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
SELECTORS = ("gpu_node_selector", "cpu_node_selector")


def check_placement(values: Mapping[str, Any]) -> None:
    """The placement parameters among `values` (those present) are what their readers accept."""
    for name in SELECTORS:
        if name in values:
            _check_selector(name, values[name])
    if "gpu_tolerations" in values:
        _check_tolerations(values["gpu_tolerations"])
    if "pod_settings" in values or "kueue_queue" in values:
        try:
            PodSettings.of(str(values.get("kueue_queue") or ""), values.get("pod_settings") or {})
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_selector(name: str, selector: Any) -> None:
    if not isinstance(selector, Mapping) or not all(isinstance(v, str) for v in selector.values()):
        raise ConfigError(
            f"parameter {name}={selector!r}: a JSON object of label: value strings, e.g. "
            '{"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}'
        )


def _check_tolerations(tolerations: Any) -> None:
    if not isinstance(tolerations, list) or not all(isinstance(t, Mapping) for t in tolerations):
        raise ConfigError(f"parameter gpu_tolerations={tolerations!r}: a JSON list of v1 Toleration objects")
    for t in tolerations:
        for key in t:
            if key not in TOLERATION_FIELDS:
                close = difflib.get_close_matches(key, TOLERATION_FIELDS, n=1)
                hint = (
                    f"; did you mean {close[0]!r}?"
                    if close
                    else f"; the fields are {list(TOLERATION_FIELDS)}"
                )
                raise ConfigError(f"gpu_tolerations: unknown field {key!r} in {dict(t)}{hint}")
        if t.get("operator", "") not in OPERATORS or t.get("effect", "") not in EFFECTS:
            raise ConfigError(
                f"gpu_tolerations: {dict(t)}: operator is one of {list(OPERATORS[1:])}, effect one of "
                f"{list(EFFECTS[1:])} (or left out)"
            )
        if t.get("operator") == "Exists" and t.get("value"):
            raise ConfigError(f"gpu_tolerations: {dict(t)}: an Exists toleration has no value")
