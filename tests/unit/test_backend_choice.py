"""`generator_backend="auto"` (generation/backend_choice.py): vLLM where the installed vLLM can serve the policy on the
generator devices, else transformers with one warning naming why; `generation_mode="auto"` follows the choice.

The facts are the installed vLLM's own (read by the probe process, cached per vLLM version); the tiny policies differ
only in head size: 32 (vLLM's CPU attention takes it) and 16 (it does not).
"""

from __future__ import annotations

import logging
import sys

import pytest
from datasets import Dataset
from transformers import AutoConfig

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.config import ConfigError
from async_rlhf.data.tiny_model import save_tiny_model
from async_rlhf.generation import backend_choice
from async_rlhf.generation.backend_choice import resolve_generator_backend, vllm_facts, why_not_vllm

pytestmark = pytest.mark.skipif(backend_choice.importlib.util.find_spec("vllm") is None, reason="needs vLLM")


@pytest.fixture(scope="module")
def head16_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("head16")), hidden_size=32, num_heads=2)


def _config(path):
    return AutoConfig.from_pretrained(path)


def _choose(args, path, architecture="LlamaForCausalLM", dtype="float32", **kw):
    return resolve_generator_backend(args, _config(path), architecture, dtype, **kw)


def test_the_installed_vllm_serves_the_tiny_policy_and_refuses_head_size_16(make_config, tiny_model_dir, head16_dir):
    facts = vllm_facts()
    assert "LlamaForCausalLM" in facts["architectures"]
    assert why_not_vllm(make_config(), _config(tiny_model_dir), "LlamaForCausalLM", "float32") is None
    if facts["platform"] == "cpu":
        reason = why_not_vllm(make_config(), _config(head16_dir), "LlamaForCausalLM", "float32")
        assert "head size 16" in reason and "32" in reason, reason


def test_auto_picks_vllm_and_streams_where_vllm_can_serve(make_config, tiny_model_dir, caplog):
    args = make_config()
    assert args.generator_backend == "auto" and args.generation_mode == "auto"
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        assert _choose(args, tiny_model_dir) == "vllm"
    assert args.generator_backend == "vllm" and args.streaming
    assert not caplog.records


def test_auto_falls_back_to_transformers_with_one_warning_naming_why(make_config, head16_dir, caplog):
    if vllm_facts()["platform"] != "cpu":
        pytest.skip("head size 16 is refused by vLLM's CPU attention only")
    args = make_config()
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        assert _choose(args, head16_dir) == "transformers"
    assert args.generator_backend == "transformers" and not args.streaming  # generation_mode 'auto': batch-level
    (record,) = caplog.records
    assert "generator_backend='auto'" in record.getMessage() and "head size 16" in record.getMessage()


@pytest.mark.parametrize("architecture, dtype, devices, expected", [
    ("NoSuchModelForCausalLM", "float32", ["cpu"], "no model for architecture NoSuchModelForCausalLM"),
    ("LlamaForCausalLM", "float64", ["cpu"], "does not support dtype float64"),
    ("LlamaForCausalLM", "float32", ["cuda:0"], "generator_devices are ['cuda:0']"),
])
def test_each_reason_vllm_cannot_serve_is_named(make_config, tiny_model_dir, architecture, dtype, devices, expected):
    facts = vllm_facts()
    if devices != ["cpu"] and facts["platform"] != "cpu":
        pytest.skip("the device mismatch case is written for the CPU build")
    reason = why_not_vllm(make_config(generator_devices=devices), _config(tiny_model_dir), architecture, dtype)
    assert reason is not None and expected in reason, reason


def test_explicit_stream_with_a_policy_vllm_cannot_serve_is_refused(make_config, head16_dir):
    if vllm_facts()["platform"] != "cpu":
        pytest.skip("head size 16 is refused by vLLM's CPU attention only")
    with pytest.raises(ConfigError, match=r"generation_mode: 'stream' needs vLLM.*head size 16"):
        _choose(make_config(generation_mode="stream"), head16_dir)


def test_explicit_backends_and_servers_are_not_second_guessed(make_config, head16_dir):
    def unused():
        raise AssertionError("vLLM's facts were read although nothing was left to decide")

    args = make_config(generator_backend="vllm")
    assert _choose(args, head16_dir, facts_fn=unused) == "vllm"  # the user's choice (vLLM then fails at start)
    args = make_config(generator_servers=["127.0.0.1:8766"])
    assert _choose(args, head16_dir, facts_fn=unused) == "vllm" and args.streaming  # servers are vLLM servers


def test_without_vllm_installed_auto_is_transformers(make_config, tiny_model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails, as on a machine without it
    args = make_config()
    assert _choose(args, tiny_model_dir) == "transformers"


def test_the_trainer_decides_before_any_generator_starts(make_config, tiny_model_dir, head16_dir, caplog):
    """Built, not trained: the choice is made in the constructor and visible as TRL's `use_vllm`."""
    data = Dataset.from_dict({"prompt": ["abc", "def"]})
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    short = dict(max_length=48, max_new_tokens=6)  # the tiny policies have 256 positions
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=reward, args=make_config(**short), train_dataset=data)
    assert trainer.args.generator_backend == "vllm" and trainer.use_vllm and trainer.args.streaming
    if vllm_facts()["platform"] == "cpu":
        with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
            trainer = AsyncOnlineDPOTrainer(head16_dir, reward_funcs=reward, args=make_config(**short),
                                            train_dataset=data)
        assert trainer.args.generator_backend == "transformers" and not trainer.use_vllm
        assert len(caplog.records) == 1


@pytest.mark.slow
def test_the_probe_reads_vllm_in_a_child_process_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path))
    monkeypatch.setattr(backend_choice, "_memo", {})
    facts = vllm_facts()  # runs `python -m async_rlhf.generation.backend_choice`
    (cached,) = (tmp_path / "vllm_facts").iterdir()
    assert cached.name.startswith(facts["vllm"]) and "LlamaForCausalLM" in facts["architectures"]


def test_partial_rollouts_with_a_policy_vllm_cannot_serve_is_refused(make_config, head16_dir):
    if vllm_facts()["platform"] != "cpu":
        pytest.skip("head size 16 is refused by vLLM's CPU attention only")
    with pytest.raises(ConfigError, match=r"partial_rollouts: needs streaming vLLM.*head size 16"):
        _choose(make_config(partial_rollouts=4, weight_load="in_flight"), head16_dir)
