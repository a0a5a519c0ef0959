import json

import pytest

from ddiloco.config.recipes import RECIPES, load_config
from ddiloco.config.run import RunConfig
from ddiloco.errors import ConfigError


def test_default_recipe_is_tiny_cpu_and_valid():
    cfg = load_config()
    assert cfg.diloco.learners == 4 and cfg.diloco.quorum == 1
    assert cfg.model.preset == "tiny" and cfg.train.device == "auto"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_validates_and_round_trips_json(name):
    cfg = load_config(name)
    again = RunConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg


def test_sync_diloco_is_k_equals_m_one_fragment():
    cfg = load_config("sync-diloco")
    assert cfg.diloco.quorum == cfg.diloco.learners and cfg.diloco.fragments == 1 and cfg.diloco.grace is None


def test_set_overrides_parse_yaml_scalars():
    cfg = load_config(
        overrides=["diloco.quorum=2", "train.lr=1e-3", "diloco.token_weighting=false", "diloco.grace=null"]
    )
    assert cfg.diloco.quorum == 2 and cfg.train.lr == 1e-3 and cfg.diloco.token_weighting is False
    assert cfg.diloco.grace is None


def test_optional_section_is_created_when_a_key_is_set():
    cfg = load_config("sync-diloco", overrides=["diloco.grace.cap_seconds=3"])
    assert cfg.diloco.grace is not None and cfg.diloco.grace.cap_seconds == 3.0


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(
        ConfigError, match=r"unknown config key 'diloco.quorom'.*did you mean 'diloco.quorum'"
    ):
        load_config(overrides=["diloco.quorom=2"])


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match="diloco.learners.*integer"):
        load_config(overrides=["diloco.learners=two"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("diloco.quorum=9", "diloco.quorum=9 must be between 1 and diloco.learners=4"),
        ("diloco.overlap=9", "diloco.overlap"),
        ("diloco.codec=int3", "choose one of fp32, bf16, int8, int4, int2"),
        ("diloco.merge=median", "choose one of rda, mean"),
        ("data.vocab_size=512", "only applies to data.tokenizer=bpe"),
        ("diloco.mixing=1.0", "diloco.mixing"),
        ("diloco.staleness_exponent=-1", "diloco.staleness_exponent=-1.0 must be ≥ 0"),
        ("diloco.max_staleness=-1", "diloco.max_staleness=-1 must be null"),
        ("model=3", "is a section"),
        ("diloco.deadline_s=0", "diloco.deadline_s=0.0 must be > 0 seconds after prepare, or null"),
        ("diloco.deadline_s=-5", "diloco.deadline_s=-5.0 must be > 0"),
        ("chaos.poisson.learners=[-1]", "chaos.poisson.learners must be learner ids"),
    ],
)
def test_inconsistent_combinations_say_what_to_change(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(overrides=[override])


def test_yaml_file_with_recipe_and_errors(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("recipe: sync-diloco\ndiloco:\n  token_budget: 1000\n")
    cfg = load_config(config_file=f)
    assert cfg.diloco.fragments == 1 and cfg.diloco.token_budget == 1000
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(config_file=f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(config_file=tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="unknown recipe"):
        load_config("nope")


def test_committed_config_files_load():
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
    assert files, "configs/ should hold the recipes as YAML"
    for f in files:
        load_config(config_file=f)


def test_per_learner_batch_sizes():
    cfg = load_config(None, None, ["train.learner_batch_sizes=[8, 32]", "train.batch_size=16"])
    assert [cfg.train.batch_for(i) for i in range(4)] == [8, 32, 16, 16]
    assert cfg.train.max_batch() == 32
    assert load_config(None, None, []).train.max_batch() == load_config(None, None, []).train.batch_size
    with pytest.raises(ConfigError, match="learner_batch_sizes.*integers ≥ 1"):
        load_config(None, None, ["train.learner_batch_sizes=[8, 0]"])


def test_robust_clip_must_be_at_least_one():
    assert load_config(None, None, ["diloco.robust_clip=3"]).diloco.robust_clip == 3
    with pytest.raises(ConfigError, match="robust_clip"):
        load_config(None, None, ["diloco.robust_clip=0.5"])


def test_staleness_rule_defaults_and_overrides():
    d = load_config(None, None, []).diloco
    assert (d.staleness_exponent, d.max_staleness) == (0.5, 8)
    d = load_config(None, None, ["diloco.staleness_exponent=0", "diloco.max_staleness=null"]).diloco
    assert (d.staleness_exponent, d.max_staleness) == (0, None)


def test_max_learners_gives_every_learner_id_a_shard():
    """Issue 17 item 10: one shard per learner id the run may have, not per provisioned learner."""
    cfg = load_config()
    assert cfg.diloco.max_learners is None and cfg.max_learners == cfg.num_shards == cfg.diloco.learners == 4
    assert load_config(overrides=["diloco.max_learners=6"]).num_shards == 6
    assert load_config(overrides=["diloco.max_learners=6", "data.num_shards=2"]).num_shards == 2
    add = "chaos.events=[{kind: add_learner, learner: 6, at_s: 5}]"
    assert load_config(overrides=[add]).num_shards == 7  # null: the chaos schedule's added ids count too
    with pytest.raises(ConfigError, match="diloco.max_learners=3 must be ≥ diloco.learners=4"):
        load_config(overrides=["diloco.max_learners=3"])
    with pytest.raises(ConfigError, match="chaos adds learner 6.*raise diloco.max_learners to 7"):
        load_config(overrides=["diloco.max_learners=5", add])
