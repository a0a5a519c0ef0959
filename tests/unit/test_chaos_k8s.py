"""The chaos role's backends: Kubernetes (against a local HTTP stand-in of the API) and local processes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from ddiloco import keys
from ddiloco.chaos.k8s import ROLE_LABEL, WORKFLOW_LABEL, ChaosBackendError, KubernetesPods
from ddiloco.chaos.local import LocalPids
from ddiloco.chaos.record import markdown_table
from ddiloco.chaos.runner import ChaosRunner
from ddiloco.cli.chaos import register
from ddiloco.config.chaos_schedule import schedule_from_config
from ddiloco.config.run import ChaosConfig, RunConfig
from ddiloco.store.memory import reset_memory_stores
from ddiloco.store.url import open_store
from tests._harness import learner_report, status

NS = "team-a"


# --- a stand-in for the Kubernetes API: list and delete pods, nothing else -------------------------------------
def _pod(name: str, workflow: str, role: str | None, phase: str = "Running") -> dict:
    labels = {WORKFLOW_LABEL: workflow}
    if role is not None:
        labels[ROLE_LABEL] = role
    return {"metadata": {"name": name, "namespace": NS, "labels": labels}, "status": {"phase": phase}}


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality (`k=v`) and set (`k in (a,b)`) requirements, comma-separated: what the chaos role sends."""
    parts, depth, cur = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    for req in (p.strip() for p in parts if p.strip()):
        if " in " in req:
            key, values = req.split(" in ", 1)
            if labels.get(key.strip()) not in {v.strip() for v in values.strip("() ").split(",")}:
                return False
        else:
            key, value = req.split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
    return True


class KubeAPIStandIn:
    """Serves GET/DELETE /api/v1/namespaces/{ns}/pods[/{name}] on loopback and records every request.
    `honour_selectors=False` returns every pod of the namespace, like a careless or hostile API would."""

    def __init__(self, pods: list[dict], honour_selectors: bool = True, forbid: bool = False) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.requests: list[dict] = []
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                standin.requests.append({"method": "GET", "path": url.path, "query": query})
                if forbid:
                    return self._send(403, {"kind": "Status", "code": 403, "reason": "Forbidden"})
                if url.path != f"/api/v1/namespaces/{NS}/pods":
                    return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                sel = query.get("labelSelector", "")
                items = [
                    p
                    for p in standin.pods.values()
                    if not honour_selectors or _selector_matches(sel, p["metadata"]["labels"])
                ]
                self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})

            def do_DELETE(self):
                url = urlsplit(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                standin.requests.append(
                    {"method": "DELETE", "path": url.path, "query": query, "body": json.loads(body or b"{}")}
                )
                name = url.path.rsplit("/", 1)[-1]
                if not url.path.startswith(f"/api/v1/namespaces/{NS}/pods/") or name not in standin.pods:
                    return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                self._send(200, standin.pods.pop(name))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KubeAPIStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def deletes(self) -> list[str]:
        return [r["path"].rsplit("/", 1)[-1] for r in self.requests if r["method"] == "DELETE"]


def two_runs() -> list[dict]:
    """Pods of our run (workflow wf-a) and of another run (wf-b) in the same namespace."""
    return [
        _pod("wf-a-learner-0", "wf-a", "learner"),
        _pod("wf-a-learner-1", "wf-a", "learner"),
        _pod("wf-a-syncer", "wf-a", "syncer"),
        _pod("wf-a-evaluate", "wf-a", None),  # our run, but no role label: never a victim
        _pod("wf-a-learner-old", "wf-a", "learner", phase="Failed"),
        _pod("wf-b-learner-0", "wf-b", "learner"),
        _pod("wf-b-learner-1", "wf-b", "learner"),
        _pod("wf-b-syncer", "wf-b", "syncer"),
    ]


@pytest.fixture
def store():
    reset_memory_stores()
    yield open_store("memory://chaos-k8s/run")
    reset_memory_stores()


def report(store, learner_id: int, incarnation: int, host: str, final: bool = False) -> None:
    doc = learner_report(learner_id=learner_id, incarnation=incarnation, host=host, pid=1, final=final)
    store.put_json(keys.report_key(learner_id, incarnation), doc.to_json())


def events(*raw: dict):
    return schedule_from_config(ChaosConfig(events=list(raw)), learners=4)


SCHEDULE = (
    {"id": "k1", "kind": "kill_learner", "learner": 1, "at_s": 0},
    {"id": "ks", "kind": "kill_syncer", "at_s": 0},
    {"id": "later", "kind": "kill_learner", "learner": 0, "at_s": 3600},
    {"id": "stall", "kind": "stall_learner", "learner": 0, "at_s": 0, "duration_s": 5},
    {"id": "step", "kind": "kill_learner", "learner": 0, "at_step": 10},
    {"id": "slow", "kind": "slow_learner", "learner": 0, "factor": 2},
)


def test_deletes_exactly_the_scheduled_pods_of_its_own_run(store):
    report(store, 1, 0, "wf-a-learner-1-gone")  # an older incarnation's pod
    report(store, 1, 1, "wf-a-learner-1")  # the newest report names the live pod
    report(store, 0, 0, "wf-a-learner-0")
    store.put_json(keys.STATUS, status(syncer_host="wf-a-syncer", syncer_pid=7).to_json())
    with KubeAPIStandIn(two_runs()) as api:
        role = ChaosRunner(
            store, KubernetesPods.connect(NS, "wf-a", host=api.url), events(*SCHEDULE), time.time()
        )
        role.poll()

        assert api.deletes() == ["wf-a-learner-1", "wf-a-syncer"]
        for r in api.requests:
            if r["method"] == "DELETE":
                assert r["query"].get("gracePeriodSeconds") == "0" and r["body"]["gracePeriodSeconds"] == 0
            else:
                assert (
                    r["query"]["labelSelector"] == f"{ROLE_LABEL} in (learner,syncer),{WORKFLOW_LABEL}=wf-a"
                )
        assert set(api.pods) == {p["metadata"]["name"] for p in two_runs()} - {
            "wf-a-learner-1",
            "wf-a-syncer",
        }

    by_id = {r.event.id: r.to_json() for r in role.records}
    assert by_id["k1"]["action"] == "deleted pod" and by_id["k1"]["pod"] == "wf-a-learner-1"
    assert by_id["ks"]["pod"] == "wf-a-syncer" and by_id["ks"]["grace_period_s"] == 0
    assert by_id["stall"]["action"].startswith("skipped (not possible on Kubernetes")
    assert "step" not in by_id and "slow" not in by_id  # the learner fires those itself
    assert [e.id for e in role.pending] == ["later"]
    for rid in ("k1", "ks", "stall"):
        assert store.get_json(keys.chaos_record_key("k8s", rid)) == by_id[rid]
    assert "wf-a-learner-1" in markdown_table(role.records)


@pytest.mark.parametrize("honour_selectors", [True, False])
def test_never_deletes_a_pod_of_another_run_or_without_the_role_label(store, honour_selectors):
    report(store, 0, 0, "wf-b-learner-0")  # a report naming another run's pod (stale, forged, or misrouted)
    report(store, 1, 0, "wf-a-evaluate")  # ... and a pod of our run that is no learner
    report(store, 2, 0, "wf-a-learner-old")  # ... and our learner pod that already failed
    store.put_json(keys.STATUS, status(syncer_host="wf-b-syncer").to_json())
    schedule = events(
        {"id": "a", "kind": "kill_learner", "learner": 0, "at_s": 0},
        {"id": "b", "kind": "kill_learner", "learner": 1, "at_s": 0},
        {"id": "c", "kind": "kill_learner", "learner": 2, "at_s": 0},
        {"id": "d", "kind": "kill_learner", "learner": 3, "at_s": 0},  # never reported at all
        {"id": "s", "kind": "kill_syncer", "at_s": 0},
    )
    with KubeAPIStandIn(two_runs(), honour_selectors=honour_selectors) as api:
        pods = KubernetesPods.connect(NS, "wf-a", host=api.url)
        assert set(pods.pods()) == {"wf-a-learner-0", "wf-a-learner-1", "wf-a-syncer"}
        role = ChaosRunner(store, pods, schedule, time.time(), victim_wait_s=0)
        records = role.run(poll_s=0)
        assert api.deletes() == []
        assert len(api.pods) == len(two_runs())
    assert sorted(r.event.id for r in records) == ["a", "b", "c", "d", "s"]
    assert all(r.action.startswith("skipped (no live") for r in records)


def test_waits_for_a_victim_that_is_not_running_yet(store):
    clock = [1000.0]
    schedule = events({"id": "k", "kind": "kill_learner", "learner": 1, "at_s": 5})
    with KubeAPIStandIn(two_runs()) as api:
        role = ChaosRunner(store, KubernetesPods.connect(NS, "wf-a", host=api.url), schedule, 1000.0,
                         victim_wait_s=30, clock=lambda: clock[0])  # fmt: skip
        role.poll()
        assert api.requests == [] and role.pending  # not due yet
        clock[0] = 1010.0
        role.poll()  # due, but learner 1 has not reported: keep waiting
        assert api.deletes() == [] and role.pending
        report(store, 1, 0, "wf-a-learner-1")
        clock[0] = 1020.0
        role.poll()
        assert api.deletes() == ["wf-a-learner-1"] and not role.pending
        assert role.records[0].to_json()["time_s"] == 20.0


def test_a_retried_chaos_step_fires_nothing_twice_and_stops_at_done(store):
    report(store, 1, 0, "wf-a-learner-1")
    schedule = events(
        {"id": "k", "kind": "kill_learner", "learner": 1, "at_s": 0},
        {"id": "never", "kind": "kill_learner", "learner": 0, "at_s": 3600},
    )
    with KubeAPIStandIn(two_runs()) as api:
        ChaosRunner(store, KubernetesPods.connect(NS, "wf-a", host=api.url), schedule, time.time()).poll()
        assert api.deletes() == ["wf-a-learner-1"]
        api.pods["wf-a-learner-1"] = _pod("wf-a-learner-1", "wf-a", "learner")  # the Argo retry, same name
        again = ChaosRunner(store, KubernetesPods.connect(NS, "wf-a", host=api.url), schedule, time.time())
        assert [e.id for e in again.pending] == ["never"]
        store.put_json(keys.DONE, {"done": True})
        assert again.run(poll_s=0) == []
        assert api.deletes() == ["wf-a-learner-1"]


def test_missing_permissions_and_workflow_are_clear_errors(store):
    with pytest.raises(ChaosBackendError, match="workflow"):
        KubernetesPods(object(), NS, "")
    with KubeAPIStandIn(two_runs(), forbid=True) as api:
        with pytest.raises(ChaosBackendError, match="list/delete on pods"):
            KubernetesPods.connect(NS, "wf-a", host=api.url).pods()


def test_cli_reads_the_run_schedule_from_the_store(tmp_path):
    url = f"file://{tmp_path}/run"
    store = open_store(url)
    cfg = RunConfig()
    cfg.run_id = "run"
    cfg.chaos = ChaosConfig(events=[{"id": "k0", "kind": "kill_learner", "learner": 0, "at_s": 0}])
    store.put_json(keys.CONFIG, cfg.to_dict())
    store.put_json(keys.DATA_META, {"prepared_at": time.time() - 1})
    report(store, 0, 0, "wf-a-learner-0")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    md = tmp_path / "out" / "chaos.md"
    with KubeAPIStandIn(two_runs()) as api:
        args = parser.parse_args(
            ["chaos", "--store", url, "--namespace", NS, "--workflow", "wf-a", "--kube-api", api.url,
             "--poll-seconds", "0.01", "--markdown-out", str(md)]
        )  # fmt: skip
        assert args.func(args) == 0
        assert api.deletes() == ["wf-a-learner-0"]
    assert store.get_json(keys.chaos_record_key("k8s", "k0"))["pod"] == "wf-a-learner-0"
    assert "| k0 | kill_learner |" in md.read_text()


def _wait_for_cmdline(pid: int, part: bytes, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while part not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"process {pid} never showed {part!r} in its command line"
        time.sleep(0.01)


def test_local_backend_kills_only_the_role_process_on_its_store(store, tmp_path):
    sleeper = "import time; time.sleep(60)"
    mine = subprocess.Popen(
        [sys.executable, "-c", sleeper, "ddiloco", "learner", "--store", "file:///runs/a"]
    )
    other = subprocess.Popen(
        [sys.executable, "-c", sleeper, "ddiloco", "learner", "--store", "file:///runs/b"]
    )
    try:
        for p in (mine, other):  # exec'd: on a loaded machine /proc still shows the parent's command a while
            _wait_for_cmdline(p.pid, b"file:///runs/")
        backend = LocalPids("file:///runs/a")
        assert backend.kill("learner", backend.hostname, other.pid) is None
        assert backend.kill("syncer", backend.hostname, mine.pid) is None
        assert backend.kill("learner", "some-other-host", mine.pid) is None
        assert backend.kill("learner", backend.hostname, mine.pid).action == "SIGKILL"
        assert mine.wait(timeout=10) == -9
        assert other.poll() is None
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
