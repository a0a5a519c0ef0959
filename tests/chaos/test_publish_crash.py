"""A real syncer process SIGKILLed inside a publish (`ddiloco.platform.failpoints`): right after it created a global
version, before the latest pointer. The restarted syncer adopts that version, and the run finishes with
every fragment past it, versions contiguous and the ledger balanced."""

import re

import pytest

from ddiloco import keys
from ddiloco.launch import LocalRun
from ddiloco.platform import failpoints
from ddiloco.run.globalmodel import latest_version
from ddiloco.store.url import open_store
from tests._harness import tiny_config

pytestmark = pytest.mark.slow

RUN = (
    "diloco.learners=2",
    "diloco.fragments=2",
    # The restarted syncer resumes near round 3 (~1k tokens merged) and merges ~5k tokens/s on this machine:
    # ~5 s more of merging, dozens of versions of every fragment past the crash version.
    "diloco.token_budget=30000",
    "lease.min_s=2",  # the restarted syncer waits out the killed one's lease
    "lease.renew_every_s=0.5",
    "restart.delay_s=0.2",
    "sft=null",
)


def test_a_syncer_killed_between_a_global_version_and_its_pointer_is_not_frozen(tmp_path):
    once = tmp_path / "failpoint-fired"
    env = {failpoints.ENV_VAR: "publish:after_global:kill@3", failpoints.ONCE_ENV_VAR: str(once)}
    run = LocalRun(tiny_config("pubkill", *RUN), tmp_path, extra_env=env, metrics_base_port=None)
    s = run.run(timeout=240)
    store = open_store(run.url)
    assert once.exists(), "the failpoint fired"
    assert s.status == "done"
    assert store.get_json(keys.SYNCER_STATE)["incarnation"] >= 1, "the syncer was restarted"
    log = (run.logdir / "syncer.log").read_text()
    adopted = re.findall(r"adopting fragment (\d+) version (\d+)", log)
    assert len(adopted) == 1, "the restarted syncer adopted the version the killed one created"
    p, v = map(int, adopted[0])
    assert "Fenced" not in log and "exits with 3" not in log
    assert s.global_versions_contiguous and s.ledger_balanced
    assert s.versions_by_multiple_epochs == 0
    assert latest_version(store, p) > v, f"fragment {p} froze at the crash version {v}"
    assert all(latest_version(store, q) > v for q in range(2)), "every fragment kept advancing"
    records = [store.get_json(k) for k in store.list(keys.ROUNDS)]
    for q in range(2):
        versions = sorted(r["version"] for r in records if r["fragment_id"] == q)
        assert versions == list(range(1, latest_version(store, q) + 1)), f"fragment {q}: {versions}"
