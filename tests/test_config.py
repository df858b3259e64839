"""Config loading: defaults, files, overrides, and one clear error per mistake."""

import pytest

from nanogrpo.config import Config, DataConfig, load_config
from nanogrpo.errors import ConfigError


def test_defaults_are_the_seeds():
    c = Config()
    assert (c.grpo.group_size, c.grpo.beta, c.train.lr, c.rollout.temperature) == (8, 0.03, 1e-6, 0.9)
    assert (c.rollout.max_new_tokens, c.data.max_prompt_tokens, c.train.save_every) == (512, 400, 200)
    assert c.grpo.eps_high() == 0.2
    assert Config(grpo={"loss": "dapo"}).grpo.eps_high() == 0.28


def test_demo_preset_and_overrides():
    c = load_config(preset="demo", overrides=["grpo.group_size=4", "grpo.beta=0", "grpo.loss=dr_grpo",
                                              "rollout.prompts_per_step=2", "rollout.max_new_tokens=9",
                                              "rollout.temperature=0.7", "train.lr=1e-5",
                                              "train.save_every=3",
                                              'rewards.functions=["format","tests.reward_fixtures:length"]',
                                              "rewards.weights=[0.5, 2]"])
    assert c.model.path == "embedded" and c.data.source == "arithmetic"
    assert (c.grpo.group_size, c.grpo.beta, c.grpo.loss) == (4, 0.0, "dr_grpo")
    assert (c.rollout.prompts_per_step, c.rollout.max_new_tokens, c.rollout.temperature) == (2, 9, 0.7)
    assert (c.train.lr, c.train.save_every) == (1e-5, 3)
    assert c.rewards.functions == ["format", "tests.reward_fixtures:length"]
    assert c.rewards.resolved_weights() == [0.5, 2.0]


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[grpo]\nbeta = 0.01\n[train]\nsteps = 7\n')
    c = load_config(f, ["train.steps=9"])
    assert c.grpo.beta == 0.01 and c.train.steps == 9
    y = tmp_path / "c.yaml"
    y.write_text("grpo:\n  group_size: 3\n")
    assert load_config(y).grpo.group_size == 3


@pytest.mark.parametrize("overrides,match", [
    (["grpo.grop_size=4"], r"unknown config key 'grpo.grop_size'.*did you mean 'group_size'"),
    (["grpoo.beta=1"], r"unknown config section 'grpoo'.*did you mean 'grpo'"),
    (["grpo.beta"], r"not of the form section.key=value"),
    (["beta=1"], r"must be section.key"),
    (["grpo.group_size=1"], r"grpo.group_size"),
    (["grpo.loss=ppo"], r"grpo.loss"),
    (["train.lr=abc"], r"train.lr"),
    (["rewards.weights=[1]"], r"rewards.weights has 1 entries but rewards.functions has 2"),
])
def test_bad_overrides_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=overrides)


def test_a_renamed_key_is_refused_in_one_line_naming_the_new(tmp_path):
    """``data.arithmetic_*_size`` size every generated source (tasks made in code, verifiers tasksets): now
    ``data.generated_*_size``; a config that still says the old name fails at start, naming the new one,
    from the command line, a file, or Python."""
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["data.arithmetic_train_size=5"])
    assert str(e.value) == ("data.arithmetic_train_size is now data.generated_train_size: rename it "
                            "(in overrides)")
    f = tmp_path / "old.toml"
    f.write_text("[data]\narithmetic_eval_size = 7\n")
    with pytest.raises(ConfigError, match=r"^data.arithmetic_eval_size is now data.generated_eval_size: "
                                          r"rename it \(in .*old.toml\)$"):
        load_config(f)
    with pytest.raises(ValueError, match="data.arithmetic_train_size is now data.generated_train_size"):
        DataConfig(arithmetic_train_size=5)
    assert load_config(overrides=["data.generated_train_size=5"]).data.generated_train_size == 5


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[grpo\nbeta = 1\n")
    with pytest.raises(ConfigError, match=r"bad.toml is malformed"):
        load_config(bad)
    unknown = tmp_path / "u.toml"
    unknown.write_text("[train]\nstep = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.step' in .*u.toml.*'steps'"):
        load_config(unknown)
    ext = tmp_path / "c.ini"
    ext.write_text("x")
    with pytest.raises(ConfigError, match="unknown extension"):
        load_config(ext)
    for msg in (str(e) for e in []):
        assert "\n" not in msg


@pytest.mark.parametrize("value,want", [
    ("{retry=true}", {"retry": True}),  # TOML's inline table, the config files' own language
    ("{retry = true, max_turns = 4, name = 'x'}", {"retry": True, "max_turns": 4, "name": "x"}),
    ('{"retry": true, "max_turns": 4}', {"retry": True, "max_turns": 4}),  # JSON
    ("{retry: true, max_turns: 4}", {"retry": True, "max_turns": 4}),  # YAML's flow mapping
    ("{tools = [{name = 'a'}, {name = 'b'}]}", {"tools": [{"name": "a"}, {"name": "b"}]}),
])
def test_override_tables_read_as_toml_json_or_yaml(value, want):
    """``env.kwargs={retry=true}`` was the key ``"retry=true"`` with no value (issue 50), handed to the
    environment library as garbage."""
    assert load_config(overrides=[f"env.kwargs={value}"]).env.kwargs == want


def test_a_word_yaml_1_1_took_for_a_boolean_stays_a_word(tmp_path):
    """``moe.routing_replay=off`` read as False (YAML 1.1 booleans: on, off, yes, no) was refused as a bad
    value; overrides and YAML config files read YAML 1.2's booleans, true and false."""
    assert load_config(overrides=["moe.routing_replay=off"]).moe.routing_replay == "off"
    assert load_config(overrides=["data.shuffle=false"]).data.shuffle is False
    f = tmp_path / "c.yaml"
    f.write_text("moe:\n  routing_replay: off\ndata:\n  shuffle: true\n")
    c = load_config(f)
    assert c.moe.routing_replay == "off" and c.data.shuffle is True


def test_override_values_of_toml_read_as_toml_does():
    c = load_config(overrides=["rewards.functions=['correctness', \"format\"]", "rewards.weights=[1, 2]",
                               "data.shuffle=false", "data.system_prompt='you are terse'"])
    assert c.rewards.functions == ["correctness", "format"] and c.rewards.weights == [1.0, 2.0]
    assert c.data.shuffle is False and c.data.system_prompt == "you are terse"


def test_an_override_neither_toml_nor_json_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["env.kwargs={retry: true, max_turns=4}"])
    said = str(e.value)
    assert "\n" not in said and "'env.kwargs={retry: true, max_turns=4}'" in said
    assert "neither JSON/YAML nor TOML" in said and "{key = value, ...}" in said
