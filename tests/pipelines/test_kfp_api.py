"""`ddiloco pipeline submit | schedule` against a local HTTP stand-in of the KFP v2beta1 API: the requests they
send, and the cron rules they enforce before sending anything."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from ddiloco.pipelines.cli import PipelineCliError, check_cron, main, parse_params
from ddiloco.pipelines.compile import golden_path

pytestmark = pytest.mark.filterwarnings("ignore:This client only works:FutureWarning")

SMOKE = str(golden_path("smoke"))


class KFPStandIn:
    """Answers the few KFP API calls kfp.Client makes (healthz, experiments, runs, recurring runs) with
    plausible JSON, and records every request with its decoded body."""

    def __init__(self, experiments: tuple[str, ...] = ()) -> None:
        self.requests: list[dict] = []
        self.experiments = {f"exp-{i}": name for i, name in enumerate(experiments)}
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _handle(self, method: str) -> None:
                url = urlsplit(self.path)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                standin.requests.append(
                    {
                        "method": method,
                        "path": url.path,
                        "query": {k: v[0] for k, v in parse_qs(url.query).items()},
                        "body": json.loads(raw) if raw else None,
                        "auth": self.headers.get("Authorization"),
                    }
                )
                self._reply(standin.answer(method, url.path, standin.requests[-1]))

            def do_GET(self):
                self._handle("GET")

            def do_POST(self):
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, method: str, path: str, req: dict) -> dict:
        if path == "/apis/v2beta1/healthz":
            return {"multi_user": False}
        if path == "/apis/v2beta1/experiments" and method == "GET":
            wanted = (
                json.loads(req["query"].get("filter", "{}")).get("predicates", [{}])[0].get("stringValue")
            )
            found = [
                {"experiment_id": i, "display_name": n} for i, n in self.experiments.items() if n == wanted
            ]
            return {"experiments": found, "total_size": len(found)}
        if path == "/apis/v2beta1/experiments":
            exp_id = f"exp-{len(self.experiments)}"
            self.experiments[exp_id] = req["body"]["display_name"]
            return {"experiment_id": exp_id, "display_name": req["body"]["display_name"]}
        if path == "/apis/v2beta1/runs":
            return {"run_id": "run-1", "display_name": req["body"]["display_name"], "experiment_id": "exp-0"}
        if path == "/apis/v2beta1/recurringruns" and method == "POST":
            return {"recurring_run_id": "rr-1", **req["body"], "status": "ENABLED"}
        if path == "/apis/v2beta1/recurringruns":  # the API's JSON uses camelCase for this list's field
            return {
                "recurringRuns": [
                    {
                        "recurring_run_id": "rr-1",
                        "display_name": "nightly",
                        "status": "ENABLED",
                        "trigger": {"cron_schedule": {"cron": "0 0 2 * * *"}},
                    },
                    {
                        "recurring_run_id": "rr-2",
                        "display_name": "hourly",
                        "status": "DISABLED",
                        "trigger": {"periodic_schedule": {"interval_second": "3600"}},
                    },
                ]  # fmt: skip
            }
        return {}

    def __enter__(self) -> KFPStandIn:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def sent(self, method: str, path: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method and r["path"] == path]


@pytest.fixture(autouse=True)
def _no_kfp_env(monkeypatch):
    for var in ("KFP_HOST", "KFP_NAMESPACE", "KFP_TOKEN"):
        monkeypatch.delenv(var, raising=False)


def test_submit_sends_the_compiled_pipeline_and_parameters(capsys):
    with KFPStandIn() as kfp_api:
        code = main(
            ["pipeline", "submit", "--host", kfp_api.url, "--package", SMOKE, "--run-name", "smoke-1",
             "--token", "t0k", "--param", "learners=3", "--param", "overrides=[diloco.codec=int4]",
             "--param", "chaos={events: [{kind: kill_learner, learner: 1, at_s: 30}]}"]
        )  # fmt: skip
    assert code == 0
    (exp,) = kfp_api.sent("POST", "/apis/v2beta1/experiments")
    assert exp["body"] == {"display_name": "ddiloco"}
    (run,) = kfp_api.sent("POST", "/apis/v2beta1/runs")
    body = run["body"]
    assert body["display_name"] == "smoke-1" and body["experiment_id"] == "exp-0"
    assert body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "ddiloco-smoke"
    assert "kubernetes" in body["pipeline_spec"]["platform_spec"]["platforms"]
    params = body["runtime_config"]["parameters"]
    assert params["learners"] == 3 and params["overrides"] == ["diloco.codec=int4"]
    assert json.loads(params["chaos"]) == {"events": [{"kind": "kill_learner", "learner": 1, "at_s": 30}]}
    assert run["auth"] == "Bearer t0k"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"] == "run-1"


def test_schedule_create_list_and_disable(capsys):
    with KFPStandIn(experiments=("nightly-runs",)) as kfp_api:
        assert main(
            ["pipeline", "schedule", "create", "--host", kfp_api.url, "--package", SMOKE, "--name", "nightly",
             "--experiment", "nightly-runs", "--cron", "0  0 2 * * *", "--param", "token_budget=200000"]
        ) == 0  # fmt: skip
        assert kfp_api.sent("POST", "/apis/v2beta1/experiments") == []  # it exists: reused, not created
        (created,) = kfp_api.sent("POST", "/apis/v2beta1/recurringruns")
        body = created["body"]
        assert body["display_name"] == "nightly" and body["experiment_id"] == "exp-0"
        assert body["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}
        assert int(body["max_concurrency"]) == 1 and body["no_catchup"] is True and body["mode"] == "ENABLE"
        assert body["runtime_config"]["parameters"] == {"token_budget": 200000}
        assert body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "ddiloco-smoke"
        capsys.readouterr()

        assert main(["pipeline", "schedule", "list", "--host", kfp_api.url]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines == ["rr-1\tENABLED\t0 0 2 * * *\tnightly", "rr-2\tDISABLED\tevery 3600s\thourly"]
        assert kfp_api.sent("GET", "/apis/v2beta1/recurringruns")[0]["query"]["page_size"] == "100"

        assert main(["pipeline", "schedule", "disable", "--host", kfp_api.url, "rr-1"]) == 0
        assert len(kfp_api.sent("POST", "/apis/v2beta1/recurringruns/rr-1:disable")) == 1


def test_five_field_cron_is_refused_before_any_request(capsys):
    with KFPStandIn() as kfp_api:
        code = main(["pipeline", "schedule", "create", "--host", kfp_api.url, "--package", SMOKE,
                     "--name", "n", "--cron", "0 2 * * *"])  # fmt: skip
    assert code == 2 and kfp_api.requests == []
    err = capsys.readouterr().err
    assert "5 fields" in err and "seconds first" in err and "'0 0 2 * * *'" in err


@pytest.mark.parametrize(
    "expr",
    ["0 0 2 * * *", "0 30 */6 * * *", "0 0 3 * * MON", "15,45 0-30/5 8-18 1 JAN-MAR ?", "0 0 0 ? * SUN-SAT"],
)
def test_valid_kfp_crons(expr):
    assert check_cron(expr) == expr


@pytest.mark.parametrize(
    ("expr", "why"),
    [
        ("* * * *", "4 fields"),
        ("60 0 2 * * *", "seconds field has '60'"),
        ("0 0 24 * * *", "hours field"),
        ("0 0 2 0 * *", "day of month field"),
        ("0 0 2 * * 7", "day of week field"),
        ("0 0 5-2 * * *", "runs backwards"),
        ("0 */0 * * * *", "step"),
        ("0 0 2 * * * 2030", "7 fields"),
    ],
)
def test_invalid_crons_say_what_is_wrong(expr, why):
    with pytest.raises(PipelineCliError, match="seconds first") as e:
        check_cron(expr)
    assert why in str(e.value)


def test_parameters_are_checked_against_the_pipeline():
    known = {"learners": 4, "chaos": "", "overrides": []}
    assert parse_params(["learners=8", "chaos=", "overrides=[a=1]"], known) == {
        "learners": 8, "chaos": "", "overrides": ["a=1"]
    }  # fmt: skip
    with pytest.raises(PipelineCliError, match="unknown pipeline parameter 'learner'.*learners"):
        parse_params(["learner=8"], known)
    with pytest.raises(PipelineCliError, match="name=value"):
        parse_params(["learners"], known)


def test_no_host_is_a_clear_error(capsys):
    assert main(["pipeline", "submit", "--package", SMOKE]) == 2
    assert "KFP_HOST" in capsys.readouterr().err


def test_importing_the_cli_does_not_import_kfp():
    import subprocess
    import sys

    code = "import sys, ddiloco.pipelines.cli, ddiloco.chaos.k8s; assert 'kfp' not in sys.modules and 'kubernetes' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(Path(__file__).resolve().parents[2]))
