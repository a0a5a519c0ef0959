"""The `join` pipeline's components under `kfp.local` (SubprocessRunner, this interpreter), `file://` store."""

from __future__ import annotations

from pathlib import Path

import pytest
from ddiloco.components.roles import build

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning"),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def comps(tmp_path_factory):
    from kfp import local

    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(ROOT))  # the component bodies import `ddiloco.components.runtime`
    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path_factory.mktemp("kfp-root")),
        raise_on_error=True,
    )
    yield build()
    mp.undo()


def test_join_check_then_a_joiner_on_a_finished_run(comps, tmp_path):
    from ddiloco import keys
    from ddiloco.run.prepare import prepare
    from ddiloco.store.url import open_store
    from tests._harness import tiny_config

    store_url = f"file://{tmp_path}/run"
    with pytest.raises(RuntimeError):
        comps.join_check(store=store_url, learners=2)  # nothing there yet
    store = open_store(store_url)
    prepare(store, tiny_config("run"))
    assert [int(i) for i in comps.join_check(store=store_url, learners=2).output] == [0, 1]
    store.put_json(keys.DONE, {"time": 0.0})
    comps.joiner(store=store_url, site="eu-west", run_tag="kfp-run", slot=0)  # sees `done` and exits 0
