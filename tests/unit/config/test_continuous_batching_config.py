"""`continuous_batching` (issue 45): TRL's names map onto it, it settles the backend and the mode where they are
'auto', what its generators cannot serve is refused before anything loads (naming the option and the fix), the
generators get its engine options and its streaming engine, and a run without it is untouched."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncGRPOConfig, AsyncRLOOConfig
from async_rlhf.errors import ConfigError
from async_rlhf.experimental import schedules
from async_rlhf.experimental.continuous_batching import ContinuousBatchingEngine
from async_rlhf.generation.pool.placement import engine_kwargs


def test_it_streams_with_transformers_and_reaches_the_generators(make_config):
    c = make_config(continuous_batching=True, continuous_batching_config='{"num_blocks": 64}')  # JSON, as a flag
    assert (c.generator_backend, c.generation_mode, c.streaming) == ("transformers", "stream", True)
    assert engine_kwargs(c, "float32") == {"dtype": "float32", "continuous_batching": {"num_blocks": 64}}
    assert schedules.stream_engine(c) is ContinuousBatchingEngine


def test_a_run_without_it_is_untouched(make_config):
    c = make_config()
    assert (c.generator_backend, c.generation_mode) == ("auto", "auto")
    assert engine_kwargs(c, "float32", "transformers") == {"dtype": "float32"}
    assert schedules.stream_engine(c) is None
    with pytest.raises(ConfigError, match="continuous_batching=True"):  # streaming transformers needs the option
        make_config(generator_backend="transformers", generation_mode="stream")


@pytest.mark.parametrize("cls", [AsyncGRPOConfig, AsyncRLOOConfig])
def test_trls_names_set_it(make_config, cls):
    c = make_config(cls, use_transformers_continuous_batching=True,
                    transformers_continuous_batching_config={"page_size": 16})
    assert c.continuous_batching and c.continuous_batching_config == {"page_size": 16}
    assert make_config(cls, use_transformers_paged=True).continuous_batching  # TRL's deprecated name
    off = make_config(cls, transformers_continuous_batching_config={"page_size": 16})  # TRL reads it only with the flag
    assert not off.continuous_batching and off.continuous_batching_config is None
    with pytest.raises(ConfigError, match="disagree"):
        make_config(cls, use_transformers_continuous_batching=True, transformers_continuous_batching_config={"a": 1},
                    continuous_batching_config={"b": 2})


@pytest.mark.parametrize("fields, words", [
    ({"generator_backend": "vllm"}, ["continuous_batching", "generator_backend='vllm'", "'transformers'"]),
    ({"generation_mode": "batch"}, ["continuous_batching", "generation_mode='batch'", "'stream'"]),
    ({"generator_servers": ["127.0.0.1:8000"]}, ["continuous_batching", "generator_servers"]),
    ({"repetition_penalty": 1.2}, ["continuous_batching", "repetition_penalty=1.2"]),
    ({"weight_transport": "network"}, ["weight_transport", "'network'"]),
    ({"continuous_batching_config": {"page_sise": 16}}, ["continuous_batching_config", "page_sise", "page_size"]),
    ({"continuous_batching_config": {"allow_block_sharing": True}}, ["continuous_batching_config",
                                                                     "allow_block_sharing"]),
    ({"continuous_batching_config": {"use_async_batching": True}}, ["use_async_batching"]),
    ({"speculative": "ngram"}, ["speculative", "generator_backend='transformers'"]),
    ({"partial_rollouts": 2, "weight_load": "in_flight", "max_staleness": 1}, ["partial_rollouts",
                                                                                "generator_backend='vllm'",
                                                                                "return whole samples"]),
    ({"tail_migration": 2, "weight_load": "in_flight", "generator_devices": ["cpu", "cpu"]},
     ["tail_migration", "generator_backend='vllm'", "return whole samples"]),
])
def test_what_its_generators_cannot_serve_is_refused(make_config, fields, words):
    with pytest.raises(ConfigError) as info:
        make_config(continuous_batching=True, **fields)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
