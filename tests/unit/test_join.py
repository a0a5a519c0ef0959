"""Joining from elsewhere: learner id claims, sites, the learner's link, and the CLI's argument rules."""

import uuid

import pytest

from ddiloco import keys
from ddiloco.cli.main import build_parser
from ddiloco.errors import ConfigError
from ddiloco.run.join import (
    check_site,
    claim_learner_id,
    default_site,
    link_for,
    reserved_ids,
    resolve_args,
)
from ddiloco.run.prepare import prepare
from ddiloco.store.shaped import Link
from ddiloco.store.url import open_store
from tests._harness import tiny_config


def _store():
    return open_store(f"memory://join-{uuid.uuid4().hex[:8]}")


def _claim(store, site="b", **kw):
    return claim_learner_id(
        store, site, provisioned=kw.pop("provisioned", 4), settle_s=0.0, sleep=lambda s: None, **kw
    )


def test_joiners_take_ids_above_the_provisioned_and_every_used_one():
    store = _store()
    assert _claim(store) == 4
    assert _claim(store, "c") == 5
    store.put_json(keys.incarnation_key(9), {"incarnation": 0})
    assert _claim(store) == 10
    claims = [store.get_json(k) for k in store.list("learners/") if "/claims/" in k]
    assert sorted(c["site"] for c in claims) == ["b", "b", "c"] and all(c["won"] for c in claims)


def test_a_contended_id_is_left_to_the_other_joiner():
    store = _store()
    first_sleep = []

    def sleep(seconds):
        if not first_sleep:  # another joiner writes its claim for the same id while we settle
            first_sleep.append(seconds)
            store.put_json(keys.claim_key(4, "someone-else"), {"site": "x"})

    lid = claim_learner_id(store, "b", provisioned=4, settle_s=0.0, sleep=sleep)
    assert lid == 5
    assert len([k for k in store.list(keys.learner_prefix(4)) if "/claims/" in k]) == 2  # 4 stays burnt


def test_a_named_joiner_takes_its_id_back_after_a_restart():
    store = _store()
    assert _claim(store, name="pod-0") == 4
    assert _claim(store, name="pod-1") == 5
    assert _claim(store, name="pod-0") == 4
    assert _claim(store, "other-site", name="pod-0") == 6  # names are per site
    with pytest.raises(ConfigError, match="join-name"):
        _claim(store, name="bad name")


def test_chaos_added_learners_are_reserved_for_the_owner():
    store = _store()
    cfg = tiny_config("join-res", "chaos.events=[{kind: add_learner, learner: 6, at_s: 30}]")
    store.put_json(keys.CONFIG, cfg.to_dict())
    assert reserved_ids(store) == 7


def test_site_names():
    assert check_site("eu-west-1") == "eu-west-1"
    for bad in ("", "a b", "-x", "é", "x" * 64):
        with pytest.raises(ConfigError, match="bad site"):
            check_site(bad)
    assert default_site({}) == "local" and default_site({"DDILOCO_SITE": "dc2"}) == "dc2"


def test_learner_link_comes_from_the_run_unless_the_learner_gives_its_own():
    store = _store()
    prepare(store, tiny_config("join-link", "link.bandwidth=10Mbit", "link.latency=50ms"))
    assert link_for(store) == Link(bandwidth=1.25e6, latency=0.05)
    assert link_for(store, "100Mbit", None) == Link(bandwidth=12.5e6, latency=0.0)
    with pytest.raises(ConfigError, match="10Mbit"):
        link_for(store, "fast", None)


def test_learner_arguments_need_a_store_or_a_join_url():
    parse = build_parser().parse_args
    url, site = resolve_args(parse(["learner", "--join", "s3://b/p/run", "--site", "eu"]))
    assert (url, site) == ("s3://b/p/run", "eu")
    assert resolve_args(parse(["learner", "--store", "file:///r", "--learner-id", "1"]))[0] == "file:///r"
    with pytest.raises(ConfigError, match="exactly one of --store"):
        resolve_args(parse(["learner", "--learner-id", "1"]))
    with pytest.raises(ConfigError, match="exactly one of --store"):
        resolve_args(parse(["learner", "--store", "x", "--join", "y"]))
    with pytest.raises(ConfigError, match="--store needs --learner-id"):
        resolve_args(parse(["learner", "--store", "x"]))
    with pytest.raises(ConfigError, match="bad site"):
        resolve_args(parse(["learner", "--join", "x", "--site", "a/b"]))
