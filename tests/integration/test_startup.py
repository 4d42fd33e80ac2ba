"""Start-up: generators spawned while the trainer is built (generation/pool/early_start.py) and used by `train()`, the
start-up timeline (trainers/startup.py), and the backend probe timing real generator processes (generation/pool/backend_probe.py).
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import time

import pytest
from datasets import Dataset

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.generation.pool import backend_choice
from async_rlhf.generation.pool import backend_probe
from async_rlhf.generation.pool.backend_probe import Workload, measure_backend
from async_rlhf.generation.pool.early_start import adopt_or_close
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.generation.engine.worker import generator_specs
from async_rlhf.types import SamplingSettings

PROMPTS = Dataset.from_dict({"prompt": ["abc", "def", "ghi", "jkl", "mno", "pqr"]})


def reward(completions, **kw):
    return [float(sum(ch.islower() for ch in c)) for c in completions]


def _generators_alive() -> set[int]:
    """Pids of this process's generator children (trainers of earlier tests, never trained, may still hold some until
    they are garbage-collected: compare with a set taken before)."""
    gc.collect()
    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("async_rlhf-generator")}


def test_generators_spawn_while_the_trainer_is_built_and_train_uses_them(tiny_model_dir, tiny_run_config, tmp_path):
    before = _generators_alive()
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=reward, train_dataset=PROMPTS,
                                    args=tiny_run_config(tmp_path / "out", generator_early_start=True))
    early = trainer._early_pool
    assert early is not None and early.processes[0].pid is not None  # spawned before train() was called
    trainer.train()
    assert early._reader is not None  # started by the pipeline: the same processes generated every batch
    marks = trainer.run_summary["startup"]
    assert marks["generators_spawned"] < marks["models_loaded"] < marks["train_called"] < marks["generators_ready"]
    assert marks["generators_ready"] < marks["first_step"]
    s = trainer.run_summary
    # the learner waited only for what was left of the start once it had built everything
    assert 0 < s["generator_start_wait_seconds"] < s["generator_start_seconds"]
    saved = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert list(saved["startup"]) == list(marks)
    assert _generators_alive() <= before


def test_early_generators_that_differ_from_those_needed_are_closed(tiny_model_dir, tiny_run_config, tmp_path, caplog):
    """A run resumed through `train(resume_from_checkpoint=...)` needs generators starting at the checkpoint's step:
    the early ones (version 0) are not used."""
    args = tiny_run_config(tmp_path)
    early = GeneratorPool(generator_specs(args, tiny_model_dir, {"dtype": "float32"}, 0), None, 60, 60)
    needed = generator_specs(args, tiny_model_dir, {"dtype": "float32"}, 2)
    with caplog.at_level(logging.INFO, logger="async_rlhf.generation.pool.early_start"):
        assert adopt_or_close(early, needed, lambda batch: None) is None
    assert "initial_version" in caplog.records[0].getMessage() and early._stopping.is_set()
    same = GeneratorPool(needed, None, 60, 60)
    assert adopt_or_close(same, needed, print) is same and same.on_rollouts is print
    same.close()


def test_without_early_start_a_built_trainer_starts_no_process_and_a_failed_train_closes_early_ones(
        tiny_model_dir, tiny_run_config, tmp_path):
    before = _generators_alive()
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=reward, train_dataset=PROMPTS,
                                    args=tiny_run_config(tmp_path / "plain"))  # a library user's default
    assert trainer._early_pool is None and _generators_alive() <= before
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=reward, train_dataset=PROMPTS,
                                    args=tiny_run_config(tmp_path / "out", generator_early_start=True))
    assert trainer._early_pool is not None
    with pytest.raises(Exception, match="no_such_checkpoint|does not exist|not found"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "no_such_checkpoint"))
    assert trainer._early_pool is None and _generators_alive() <= before  # closed by train(), not left to the gc


def test_a_trainer_that_fails_to_build_leaves_no_generator_behind(tiny_model_dir, tiny_run_config, tmp_path):
    before = _generators_alive()
    with pytest.raises(OSError) as failure:  # the reference model fails to load after the generator was spawned
        AsyncOnlineDPOTrainer(tiny_model_dir, ref_model=str(tmp_path / "no_such_model"), reward_funcs=reward,
                              args=tiny_run_config(tmp_path / "out", generator_early_start=True),
                              train_dataset=PROMPTS)
    assert any(entry.name == "_build" for entry in failure.traceback)  # failed in the part after the spawn
    assert _generators_alive() <= before


def test_the_probe_times_a_real_transformers_generator(tiny_model_dir, tiny_run_config, tmp_path):
    before = _generators_alive()
    args = tiny_run_config(tmp_path)
    workload = Workload(tiny_model_dir, [[5, 6, 7], [8, 9]], SamplingSettings(max_new_tokens=6, n=2, seed=0), 10,
                        extra_prompt_token_ids=[[10, 11], [12], [13, 14], [15]])
    t0 = time.monotonic()
    figures = measure_backend("transformers", args, workload, "float32", timeout=120)
    assert 0 < figures["start_seconds"] < time.monotonic() - t0
    assert figures["mode"] == "batch" and figures["step_tokens"] == 2 * 2 * 6 and len(figures["rounds"]) == 3
    assert 0 < figures["step_seconds"] <= max(figures["rounds"]) and figures["warmup_seconds"] >= 0
    assert (tmp_path / "logs" / "probe-transformers.log").is_file()
    assert _generators_alive() <= before


@pytest.mark.slow
def test_auto_times_both_backends_once_and_then_reads_the_cache(tiny_model_dir, make_config, tmp_path, monkeypatch,
                                                                caplog):
    """The whole measurement on the tiny policy: a vLLM engine and a transformers generator, one after the other."""
    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path / "cache"))
    args = make_config(max_length=48, max_new_tokens=6, per_device_train_batch_size=2)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    workload = Workload(tiny_model_dir, [[5, 6, 7], [8, 9]], SamplingSettings(max_new_tokens=6, n=2, seed=0), 10)
    with caplog.at_level(logging.WARNING, logger=backend_choice.__name__):
        chosen = backend_choice.resolve_generator_backend(args, config, "LlamaForCausalLM", "float32",
                                                          workload=workload)
    figures = backend_probe.read_cached(backend_probe.cache_path(make_config(max_length=48, max_new_tokens=6),
                                                                 config, "float32"))
    assert figures["vllm"]["mode"] == "stream" and figures["transformers"]["mode"] == "batch", figures
    predicted = {b: backend_probe.predicted_seconds(figures[b], workload) for b in backend_probe.BACKENDS}
    assert chosen == min(predicted, key=predicted.get)
    assert f"generator_backend='auto': {chosen}, measured faster" in caplog.records[0].getMessage()
    t0 = time.monotonic()
    again = make_config(max_length=48, max_new_tokens=6, per_device_train_batch_size=2)
    assert backend_choice.resolve_generator_backend(again, config, "LlamaForCausalLM", "float32",
                                                    workload=workload) == chosen
    assert time.monotonic() - t0 < 5  # read from the cache: no engine started
