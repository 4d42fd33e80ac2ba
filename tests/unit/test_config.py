import pytest

from async_rlhf.config.cli import parse_args
from async_rlhf.errors import ConfigError
from async_rlhf.config.algorithms import AsyncOnlineDPOConfig


def test_defaults_are_valid_and_cpu_sized(make_config):
    c = make_config()
    assert c.max_staleness == 1 and c.sync_every == 1 and c.generator_devices == ["cpu"]
    assert c.beta == 0.1 and c.loss_type == "sigmoid"
    assert c.report_to == []  # logs to no integration by default (transformers turns its default "none" into [])


@pytest.mark.parametrize("kw, field", [
    ({"max_staleness": -1}, "max_staleness"),
    ({"sync_every": 3, "max_staleness": 1}, "sync_every"),
    ({"generator_backend": "tgi"}, "generator_backend"),
    ({"generator_devices": ["gpu0"]}, "generator_devices"),
    ({"max_new_tokens": 600, "max_length": 512}, "max_new_tokens"),
    ({"num_generations": 1}, "num_generations"),
    ({"loss_type": "hinge"}, "loss_type"),
    ({"beta": -0.1}, "beta"),
    ({"top_p": 0.0}, "top_p"),
    ({"reward_failure": "ignore"}, "reward_failure"),
    ({"num_mini_batches": 4, "max_staleness": 0}, "num_mini_batches"),
])
def test_bad_values_name_the_field(make_config, kw, field):
    with pytest.raises(ConfigError, match=field):
        make_config(**kw)


def test_num_mini_batches_is_the_papers_N(make_config):
    c = make_config(num_mini_batches=4)
    assert (c.sync_every, c.max_staleness) == (4, 3)
    c = make_config(num_mini_batches=1)
    assert (c.sync_every, c.max_staleness) == (1, 0)


def test_beta_schedule_per_epoch(make_config):
    c = make_config(beta=[0.1, 0.05])
    assert c.beta_at(0.5) == 0.1 and c.beta_at(1.2) == 0.05 and c.beta_at(7) == 0.05


def test_yaml_config_and_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_staleness: 2\nbeta: 0.2\ngenerator_backend: transformers\n")
    (c,) = parse_args((AsyncOnlineDPOConfig,), ["--config", str(cfg), "--output_dir", str(tmp_path), "--beta", "0.3"])
    assert c.max_staleness == 2 and c.beta == 0.3 and c.generator_backend == "transformers"


def test_yaml_misspelled_field_suggests_the_right_one(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("max_stalenes: 2\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown field\(s\) 'max_stalenes' \(did you mean max_staleness"):
        parse_args((AsyncOnlineDPOConfig,), ["--config", str(cfg)])


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args((AsyncOnlineDPOConfig,), ["--config", "/nonexistent.yaml"])
