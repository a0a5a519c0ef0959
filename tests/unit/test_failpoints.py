"""`ddiloco.platform.failpoints`: the spec read from the environment, firing at the n-th hit only, once per run with a
marker file, and a clear error for a spec that names nothing real."""

import pytest

from ddiloco.platform import failpoints
from ddiloco.store.base import StoreUnavailable


@pytest.fixture(autouse=True)
def _disarm():
    yield
    failpoints.disarm()
    failpoints.load_env({})


def test_unset_arms_nothing():
    failpoints.load_env({})
    for step in failpoints.STEPS["publish"]:
        failpoints.hit("publish", step)  # nothing happens


def test_a_point_fires_at_its_nth_hit_only():
    failpoints.load_env({failpoints.ENV_VAR: "publish:after_global:store_error@2, publish:after_state:raise"})
    failpoints.hit("publish", "after_global")
    with pytest.raises(StoreUnavailable, match="after_global"):
        failpoints.hit("publish", "after_global")
    failpoints.hit("publish", "after_global")  # fired once
    with pytest.raises(failpoints.FailpointCrash):
        failpoints.hit("publish", "after_state")


def test_a_marker_file_makes_a_point_fire_once_per_run(tmp_path):
    env = {failpoints.ENV_VAR: "publish:after_record:raise", failpoints.ONCE_ENV_VAR: str(tmp_path / "fired")}
    failpoints.load_env(env)
    with pytest.raises(failpoints.FailpointCrash):
        failpoints.hit("publish", "after_record")
    failpoints.load_env(env)  # a restarted process with the same environment
    failpoints.hit("publish", "after_record")


@pytest.mark.parametrize(
    "spec", ["publish:after_global", "publish:after_lunch:kill", "publish:after_global:explode", "a:b:c@x"]
)
def test_a_bad_spec_is_refused_with_what_is_known(spec):
    with pytest.raises(ValueError, match="failpoint|DDILOCO_FAILPOINT"):
        failpoints.load_env({failpoints.ENV_VAR: spec})
