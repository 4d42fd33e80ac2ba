"""TRL 1.16 OnlineDPOConfig's generation fields on our configs (async_rlhf/config/trl_fields.py): mapped onto ours where
they have a meaning here, conflicts refused naming both fields, and our ConfigError is the ValueError TRL users
catch. The no-op fields' single warning is checked in tests/compat/test_online_dpo_compat.py."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncOnlineDPOConfig, AsyncRLOOConfig
from async_rlhf.config.cli import parse_args
from async_rlhf.errors import ConfigError


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("use_vllm, backend", [(None, "auto"), (True, "vllm"), (False, "transformers")])
def test_use_vllm_picks_the_generator_backend(make_config, use_vllm, backend):
    assert make_config(use_vllm=use_vllm).generator_backend == backend


def test_use_vllm_that_contradicts_generator_backend_is_refused(make_config):
    with pytest.raises(ConfigError, match=r"use_vllm: False asks for generator_backend='transformers' but "
                                          r"generator_backend='vllm' was set"):
        make_config(use_vllm=False, generator_backend="vllm")


def test_vllm_server_mode_points_generator_servers_at_the_server(make_config):
    assert make_config(use_vllm=True, vllm_mode="server").generator_servers == ["127.0.0.1:8000"]
    config = make_config(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://10.0.0.5:9000")
    assert config.generator_servers == ["http://10.0.0.5:9000"]
    assert make_config(vllm_mode="server").generator_servers is None  # TRL: server mode only matters with use_vllm
    with pytest.raises(ConfigError, match=r"vllm_mode: 'remote' is not one of \('colocate', 'server'\)"):
        make_config(vllm_mode="remote")


def test_generation_kwargs_override_our_sampling_fields(make_config):
    config = make_config(temperature=0.8, generation_kwargs={"top_k": 5, "max_tokens": 17, "min_p": 0.05,
                                                              "repetition_penalty": 1.3})
    assert (config.top_k, config.max_new_tokens, config.min_p, config.repetition_penalty) == (5, 17, 0.05, 1.3)
    assert config.temperature == 0.8
    assert make_config(temperature=0.8, generation_kwargs={"do_sample": False}).temperature == 0.0  # greedy
    with pytest.raises(ConfigError, match="temperature: expected a number, got 'hot'"):
        make_config(generation_kwargs={"temperature": "hot"})
    with pytest.raises(ConfigError, match=r"min_p: must be in \[0, 1\]"):
        make_config(min_p=1.5)


def test_trl_fields_from_the_command_line(tmp_path):
    (config,) = parse_args((AsyncOnlineDPOConfig,), [
        "--output_dir", str(tmp_path), "--use_vllm", "false", "--generation_kwargs", '{"do_sample": false, "top_k": 5}',
        "--model_init_kwargs", '{"dtype": "float32"}', "--repetition_penalty", "1.1"])
    assert config.generator_backend == "transformers" and config.temperature == 0.0 and config.top_k == 5
    assert config.model_init_kwargs == {"dtype": "float32"} and config.repetition_penalty == 1.1
    with pytest.raises(ConfigError, match="generation_kwargs: .* is not a JSON object"):
        parse_args((AsyncOnlineDPOConfig,), ["--output_dir", str(tmp_path), "--generation_kwargs", "{top_k: 5}"])


def test_every_algorithm_config_takes_them(make_config):
    config = make_config(AsyncRLOOConfig, use_vllm=False, generation_kwargs={"top_p": 0.5})
    assert config.generator_backend == "transformers" and config.top_p == 0.5
