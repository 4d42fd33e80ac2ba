"""A real run with the reference log-probs computed on rank 0's scoring thread (`reference_while_generating`)
trains the same steps as one whose learner runs the reference itself, and its step runs no reference
forward. Runs in process with a real generator process (transformers backend, a tiny model)."""

from __future__ import annotations

import threading

import pytest

from async_rlhf import AsyncOnlineDPOTrainer, AsyncRLOOConfig, AsyncRLOOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts


def _run(tmp_path, tiny_model_dir, tiny_run_config, fused: bool, rloo: bool):
    # max_staleness 1: batches 0 and 1 are both sampled by the initial policy, so both runs train on the same samples
    fields = dict(max_steps=2, logging_steps=1, max_staleness=1, seed=3, reference_while_generating=fused)
    if rloo:  # a policy-gradient learner: reference at the sampling temperature, every row
        config = AsyncRLOOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                                 max_new_tokens=6, max_length=48, learning_rate=5e-3, lr_scheduler_type="constant",
                                 generator_backend="transformers", disable_tqdm=True, rollout_timeout=120,
                                 temperature=0.8, **fields)
        trainer = AsyncRLOOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                                   train_dataset=toy_prompts(16))
    else:
        trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward,
                                        args=tiny_run_config(tmp_path, **fields), train_dataset=toy_prompts(16))
    threads = []  # the thread of every reference forward
    trainer.ref_model.register_forward_hook(lambda *_: threads.append(threading.current_thread().name))
    trainer.train()
    logs = [m for m in trainer.state.log_history if "loss" in m]
    return trainer, logs, set(threads)


@pytest.mark.slow  # an experimental option (experimental/fused_reference.py); its arithmetic is unit-tested
@pytest.mark.parametrize("rloo", [False, True])
def test_the_fused_reference_trains_the_same_steps_without_a_reference_forward_in_the_step(
        tmp_path, tiny_model_dir, tiny_run_config, rloo):
    fused, fused_logs, fused_threads = _run(tmp_path / "fused", tiny_model_dir, tiny_run_config, True, rloo)
    plain, plain_logs, plain_threads = _run(tmp_path / "plain", tiny_model_dir, tiny_run_config, False, rloo)
    assert fused_threads == {"async_rlhf-scorer"}  # the step ran no reference forward
    assert plain_threads == {"MainThread"}
    stats = fused.pipeline.stats()
    assert stats["scoring/reference_seconds"] > 0 and 0 <= stats["scoring/reference_hidden_fraction"] <= 1
    assert "scoring/reference_seconds" not in plain.pipeline.stats()
    assert len(fused_logs) == len(plain_logs) == 2
    for f, p in zip(fused_logs, plain_logs):
        assert f["objective/kl"] == pytest.approx(p["objective/kl"], abs=1e-4)
        assert f["loss"] == pytest.approx(p["loss"], abs=1e-4)
