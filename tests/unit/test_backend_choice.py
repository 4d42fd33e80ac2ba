"""`generator_backend="auto"` (generation/pool/backend_choice.py): transformers where the installed vLLM cannot serve the
policy on the generator devices, with one warning naming why; where it can, on CPU, the backend measured faster for
the run (`backend_probe.py`'s figures, cached per policy shape and machine), with one line giving the figures;
`generation_mode="auto"` follows the choice.

The facts are the installed vLLM's own (read by the probe process, cached per vLLM version); the tiny policies differ
only in head size: 32 (vLLM's CPU attention takes it) and 16 (it does not). The measurement itself (real generator
processes) is tested in tests/integration/test_startup.py; here the decision reads figures from the cache, written in
a temporary `ASYNC_RLHF_CACHE` with the module's own writer.
"""

from __future__ import annotations

import logging
import sys

import pytest
from datasets import Dataset
from transformers import AutoConfig

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.errors import ConfigError
from async_rlhf.data.tiny_model import save_tiny_model
from async_rlhf.generation.pool import backend_choice
from async_rlhf.generation.pool import backend_probe
from async_rlhf.generation.pool.backend_choice import resolve_generator_backend, vllm_facts, why_not_vllm
from async_rlhf.generation.pool.backend_probe import Workload
from async_rlhf.types import SamplingSettings

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


def _workload(path, steps, prompts=4, n=2, tokens=6):
    return Workload(path, [[1, 2, 3]] * prompts, SamplingSettings(max_new_tokens=tokens, n=n), steps)


def _figures(start, step, warmup=0.0, step_tokens=48, mode="batch"):
    return {"start_seconds": start, "warmup_seconds": warmup, "step_seconds": step, "step_tokens": step_tokens,
            "rounds": [warmup + step, step, step], "mode": mode}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """`cache(args, path, transformers=..., vllm=...)`: figures as the probe caches them, in a temporary cache."""
    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path / "cache"))

    def write(args, path, **figures):
        backend_probe.write_cached(backend_probe.cache_path(args, _config(path), "float32"), figures)
    return write


def test_auto_without_a_policy_directory_takes_vllm_unmeasured(make_config, tiny_model_dir, caplog):
    args = make_config()
    assert args.generator_backend == "auto" and args.generation_mode == "auto"
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        assert _choose(args, tiny_model_dir) == "vllm"  # no workload: an in-memory policy
    assert args.generator_backend == "vllm" and args.streaming
    (record,) = caplog.records
    assert "vllm (not measured: the policy has no local directory" in record.getMessage()


def test_auto_on_cpu_takes_the_backend_measured_faster_for_the_run(make_config, tiny_model_dir, cache, caplog):
    """transformers starts in 4 s and samples a step in 0.2 s; vLLM starts in 9 s, warms up 1 s, then 0.1 s a step.
    50 steps: 4 + 50 x 0.2 = 14 s against 9 + 1 + 50 x 0.1 = 15 s; 100 steps: 24 s against 20 s."""
    cache(make_config(), tiny_model_dir, transformers=_figures(4.0, 0.2), vllm=_figures(9.0, 0.1, 1.0, mode="stream"))
    args = make_config()
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        assert _choose(args, tiny_model_dir, workload=_workload(tiny_model_dir, 50)) == "transformers"
    assert args.generator_backend == "transformers" and not args.streaming  # generation_mode 'auto': batch-level
    (record,) = caplog.records
    line = record.getMessage()
    assert line.startswith("generator_backend='auto': transformers, measured faster for this run of 50 steps"), line
    assert "transformers starts in 4.0 s" in line and ": 14.0 s for this run" in line and ": 15.0 s" in line, line
    args = make_config()
    assert _choose(args, tiny_model_dir, workload=_workload(tiny_model_dir, 100)) == "vllm"
    assert args.streaming
    # the step time scales with samples x max_new_tokens: twice the tokens per step, and transformers' longer steps
    # lose at 50 steps too (4 + 50 x 0.4 = 24 s against 10 + 50 x 0.2 = 20 s)
    assert _choose(make_config(), tiny_model_dir, workload=_workload(tiny_model_dir, 50, tokens=12)) == "vllm"


def test_a_backend_that_failed_its_probe_is_not_chosen(make_config, tiny_model_dir, cache, caplog):
    cache(make_config(), tiny_model_dir, transformers=_figures(40.0, 2.0), vllm={"error": "engine died"})
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        assert _choose(make_config(), tiny_model_dir, workload=_workload(tiny_model_dir, 10)) == "transformers"
    assert "vllm failed (engine died)" in caplog.records[0].getMessage()
    cache(make_config(), tiny_model_dir, transformers={"error": "no memory"}, vllm={"error": "engine died"})
    with pytest.raises(RuntimeError, match="neither backend could start.*no memory.*engine died"):
        _choose(make_config(), tiny_model_dir, workload=_workload(tiny_model_dir, 10))


@pytest.mark.parametrize("setting", [{"generation_mode": "stream"}, {"weight_load": "in_flight"}])
def test_settings_only_vllm_has_take_vllm_unmeasured(make_config, tiny_model_dir, cache, setting, caplog, tmp_path):
    args = make_config(**setting)
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        assert _choose(args, tiny_model_dir, workload=_workload(tiny_model_dir, 10)) == "vllm"
    assert f"({next(iter(setting))} needs it)" in caplog.records[0].getMessage()
    assert not (tmp_path / "cache" / "backend_choice").exists()  # nothing was measured


def test_trl_use_vllm_true_forces_vllm(make_config, tiny_model_dir):
    def unused():
        raise AssertionError("vLLM's facts were read although use_vllm=True decided")

    args = make_config(use_vllm=True)
    assert _choose(args, tiny_model_dir, facts_fn=unused, workload=_workload(tiny_model_dir, 10)) == "vllm"
    assert args.streaming


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


def test_the_trainer_decides_before_any_generator_starts(make_config, tiny_model_dir, head16_dir, cache, caplog):
    """Built, not trained: the choice is made in the constructor, visible as TRL's `use_vllm`, and the generator it
    chose is already spawned (`early_start.py`)."""
    data = Dataset.from_dict({"prompt": ["abc", "def"]})
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    short = dict(max_length=48, max_new_tokens=6, per_device_train_batch_size=2,  # the tiny policies: 256 positions
                 generator_early_start=True)
    if vllm_facts()["platform"] != "cpu":
        pytest.skip("written for CPU generators")
    cache(make_config(**short), tiny_model_dir, transformers=_figures(4.0, 0.2), vllm=_figures(9.0, 0.2))
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=reward, args=make_config(**short),
                                        train_dataset=data)
    try:
        assert trainer.args.generator_backend == "transformers" and not trainer.use_vllm
        assert "measured faster" in caplog.records[0].getMessage()
        assert trainer._early_pool.specs[0].backend == "transformers" and trainer._early_pool.processes[0].pid
    finally:
        trainer._early_pool.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        trainer = AsyncOnlineDPOTrainer(head16_dir, reward_funcs=reward, args=make_config(**short),
                                        train_dataset=data)
    trainer._early_pool.close()
    assert trainer.args.generator_backend == "transformers" and not trainer.use_vllm
    assert len(caplog.records) == 1 and "head size 16" in caplog.records[0].getMessage()


@pytest.mark.slow
def test_the_probe_reads_vllm_in_a_child_process_and_caches_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path))
    monkeypatch.setattr(backend_choice, "_memo", {})
    facts = vllm_facts()  # runs `python -m async_rlhf.generation.pool.backend_choice`
    (cached,) = (tmp_path / "vllm_facts").iterdir()
    assert cached.name.startswith(facts["vllm"]) and "LlamaForCausalLM" in facts["architectures"]


def test_partial_rollouts_with_a_policy_vllm_cannot_serve_is_refused(make_config, head16_dir):
    if vllm_facts()["platform"] != "cpu":
        pytest.skip("head size 16 is refused by vLLM's CPU attention only")
    with pytest.raises(ConfigError, match=r"partial_rollouts: needs streaming vLLM.*head size 16"):
        _choose(make_config(partial_rollouts=4, weight_load="in_flight"), head16_dir)


def test_each_timed_step_samples_prompts_of_its_own():
    """vLLM caches prompt prefixes: a probe that sampled the same prompts every round would time steps faster than
    any of the run's. Rounds take the next prompts while there are enough, else repeat the first step's."""
    w = Workload("policy", [[1], [2]], SamplingSettings(max_new_tokens=4, n=2), 10,
                 extra_prompt_token_ids=[[3], [4], [5]])
    assert [w.round_prompts(r) for r in range(3)] == [[[1], [2]], [[3], [4]], [[1], [2]]]
    assert w.step_tokens == 2 * 2 * 4  # one step: the first step's prompts only
