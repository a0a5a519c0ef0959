"""A stand-in for the Kubernetes API server: the pod calls `ddiloco/chaos_k8s.py` makes, on loopback.

The keeper (components/keeper_loop.py KubePods) creates pods (POST /api/v1/namespaces/{ns}/pods, served by
workers.py: 201 with the pod, 409 AlreadyExists for a taken name), reads and deletes them, and reads its run's
Workflow (GET /apis/argoproj.io/v1alpha1/namespaces/{ns}/workflows/{name}, apiview.py).

`KubernetesPods` (the official `kubernetes` client) calls `list_namespaced_pod(ns, label_selector=...)`
(GET /api/v1/namespaces/{ns}/pods?labelSelector=...) and reads `items[].metadata.name/labels/
deletionTimestamp` and `items[].status.phase`; then `delete_namespaced_pod(name, ns, grace_period_seconds=0,
body=V1DeleteOptions(grace_period_seconds=0))` (DELETE /api/v1/namespaces/{ns}/pods/{name}), where a 404
means "already gone". GET of one pod is served too.

Design choices:
- The pods are the twin's pods, live: created pods are listed (Pending until scheduled and started, then
  Running, then Succeeded/Failed), a deleted pod is gone at once. A delete with grace period 0 is a force
  delete: the pod's processes get SIGKILL and Argo records the node as Error "pod deleted"; a delete with a
  grace period sends SIGTERM first (the twin's `PodTable.delete` does the killing and the recording).
- TrainJobs (trainer.kubeflow.org/v1alpha1, a multi-node learner's keeper): create, get, list with a label
  selector, delete with a propagationPolicy, served by trainjobs.py.
- No authentication, no watch, no PATCH, no other resources: anything else is a 404 (a 405 for other verbs), and
  every request is recorded for the test to look at.
- The chaos pod reaches it through a kubeconfig the twin writes: KubernetesPods.connect tries
  `config.load_incluster_config()` first, which raises ConfigException without KUBERNETES_SERVICE_HOST/PORT
  (kubernetes/config/incluster_config.py InClusterConfigLoader._load_config) - the twin never sets them - and
  then `config.load_kube_config()`, which reads $KUBECONFIG (kubernetes/config/kube_config.py reads it into
  KUBE_CONFIG_DEFAULT_LOCATION at import time: it must be in the pod's env when the process starts).

Rules and their sources:
- Label selectors: comma-separated requirements `k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`,
  `k notin (a,b)`; all must hold (k8s.io/apimachinery/pkg/labels/selector.go Parse). `notin` and `!=`
  also match pods without the label.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qs, unquote, urlsplit

_REQ = re.compile(
    r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9_.-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


class PodTable(Protocol):
    def list_pods(self, namespace: str) -> list[dict[str, Any]]: ...

    def delete_pod(
        self, namespace: str, name: str, grace_period_s: float | None
    ) -> dict[str, Any] | None: ...

    def create_pod(self, namespace: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]: ...

    def get_workflow(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def list_trainjobs(self, namespace: str) -> list[dict[str, Any]]: ...

    def create_trainjob(self, namespace: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]: ...

    def delete_trainjob(
        self, namespace: str, name: str, propagation: str | None
    ) -> dict[str, Any] | None: ...


def _split(selector: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in selector:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [p for p in [*parts, cur] if p.strip()]


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """labels.Parse(selector).Matches(labels); a malformed selector raises ValueError."""
    for req in _split(selector):
        m = _REQ.match(req)
        if not m:
            raise ValueError(f"unable to parse requirement: {req!r}")
        neg, key, op, val, setop, values = m.groups()
        if neg:
            if op or setop:
                raise ValueError(f"unable to parse requirement: {req!r}")
            ok = key not in labels
        elif op in ("=", "=="):
            ok = labels.get(key) == val
        elif op == "!=":
            ok = labels.get(key) != val
        elif setop:
            members = {v.strip() for v in values.split(",")}
            ok = labels.get(key) in members if setop == "in" else labels.get(key) not in members
        else:
            ok = key in labels
        if not ok:
            return False
    return True


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class KubeAPI:
    """ThreadingHTTPServer on 127.0.0.1:<ephemeral>; `record(request)` is called for every request."""

    def __init__(self, pods: PodTable, record: Callable[[dict[str, Any]], None]) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                try:
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller was killed by its own request (a pod deleting itself)

            def _route(self, method: str) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                record({"method": method, "path": url.path, "query": query, "body": body})
                code, out = api.handle(method, unquote(url.path), query, body)
                self._send(code, out)

            def do_GET(self) -> None:
                self._route("GET")

            def do_DELETE(self) -> None:
                self._route("DELETE")

            def do_POST(self) -> None:
                self._route("POST")

            def do_PATCH(self) -> None:
                self._route("PATCH")

        self.pods = pods
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="twin-kube-api", daemon=True)

    def handle(self, method: str, path: str, query: dict[str, str], body: dict[str, Any]) -> tuple[int, dict]:
        wf = re.fullmatch(r"/apis/argoproj.io/v1alpha1/namespaces/([^/]+)/workflows/([^/]+)", path)
        if wf and method == "GET":
            found = self.pods.get_workflow(*wf.groups())
            return (
                (200, found)
                if found
                else (404, _status(404, "NotFound", f'workflows.argoproj.io "{wf.group(2)}" not found'))
            )
        tj = re.fullmatch(
            r"/apis/trainer.kubeflow.org/v1alpha1/namespaces/([^/]+)/trainjobs(?:/([^/]+))?", path
        )
        if tj:
            return self._trainjobs(method, *tj.groups(), query, body)
        m = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?", path)
        if not m:
            return 404, _status(404, "NotFound", f"the server could not find the requested resource ({path})")
        ns, name = m.groups()
        if name is None and method == "GET":
            try:
                items = [
                    p
                    for p in self.pods.list_pods(ns)
                    if selector_matches(query.get("labelSelector", ""), p["metadata"]["labels"])
                ]
            except ValueError as e:
                return 400, _status(400, "BadRequest", str(e))
            return 200, {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"},
                "items": items,
            }
        if name is None and method == "POST":
            code, out = self.pods.create_pod(ns, body)
            return code, out if code < 300 else _status(code, out["reason"], out["message"])
        if name is not None and method == "GET":
            found = [p for p in self.pods.list_pods(ns) if p["metadata"]["name"] == name]
            return (200, found[0]) if found else (404, _status(404, "NotFound", f'pods "{name}" not found'))
        if name is not None and method == "DELETE":
            grace = query.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
            gone = self.pods.delete_pod(ns, name, None if grace is None else float(grace))
            return (200, gone) if gone else (404, _status(404, "NotFound", f'pods "{name}" not found'))
        return 405, _status(405, "MethodNotAllowed", f"{method} is not supported by the twin's API stand-in")

    def _trainjobs(
        self, method: str, ns: str, name: str | None, query: dict[str, str], body: dict[str, Any]
    ) -> tuple[int, dict]:
        """The TrainJob calls of a multi-node learner's keeper (components/keeper_loop.py KubeTrainJobs)."""
        gone = (404, _status(404, "NotFound", f'trainjobs.trainer.kubeflow.org "{name}" not found'))
        if name is None and method == "GET":
            try:
                items = [
                    j
                    for j in self.pods.list_trainjobs(ns)
                    if selector_matches(query.get("labelSelector", ""), j["metadata"].get("labels") or {})
                ]
            except ValueError as e:
                return 400, _status(400, "BadRequest", str(e))
            return 200, {
                "apiVersion": "trainer.kubeflow.org/v1alpha1",
                "kind": "TrainJobList",
                "items": items,
            }
        if name is None and method == "POST":
            code, out = self.pods.create_trainjob(ns, body)
            return code, out if code < 300 else _status(code, out["reason"], out["message"])
        if name is not None and method == "GET":
            found = [j for j in self.pods.list_trainjobs(ns) if j["metadata"]["name"] == name]
            return (200, found[0]) if found else gone
        if name is not None and method == "DELETE":
            propagation = body.get("propagationPolicy") or query.get("propagationPolicy")
            out = self.pods.delete_trainjob(ns, name, propagation)
            return (200, out) if out else gone
        return 405, _status(405, "MethodNotAllowed", f"{method} is not supported by the twin's API stand-in")

    def start(self) -> KubeAPI:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def write_kubeconfig(self, path: Path, namespace: str) -> Path:
        """A kubeconfig pointing at this server, no credentials."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: twin\n  cluster:\n    server: {self.url}\n"
            "users:\n- name: twin\n  user: {}\n"
            "contexts:\n- name: twin\n  context:\n    cluster: twin\n    user: twin\n"
            f"    namespace: {namespace}\n"
            "current-context: twin\n"
        )
        return path
