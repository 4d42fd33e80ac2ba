"""A training run with speculative rollouts (issue 34): a streaming vLLM generator with the history proposer trains
under the staleness bound exactly as without it (per-step records checked), and the speculation counters reach the
metrics and the run summary."""

from __future__ import annotations

import pytest
from run_records import check_staleness_records

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts


@pytest.mark.slow  # a full run; exactness stays in the default tier (test_speculative_exactness.py)
def test_a_run_with_history_drafts(tmp_path, tiny_model_dir):
    pytest.importorskip("vllm")
    steps = 3
    config = AsyncOnlineDPOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
                                  max_new_tokens=24, max_length=64, generator_backend="vllm", generator_threads=1,
                                  max_staleness=1, speculative="history", num_speculative_tokens=3,
                                  learning_rate=1e-3, disable_tqdm=True, seed=0)
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                                    train_dataset=toy_prompts(40))
    trainer.train()
    s = trainer.run_summary
    check_staleness_records(tmp_path, steps, 1, s, dropped=0)
    sp = s["speculative"]
    assert sp["method"] == "history" and sp["num_speculative_tokens"] == 3
    assert sp["drafted_tokens"] > 0 and sp["wasted_tokens"] <= sp["drafted_tokens"]
    assert 0 <= sp["acceptance_rate"] <= 1 and sp["mean_accepted_length"] >= 0
    logged = [m for m in trainer.state.log_history if "generator/spec_drafted_tokens" in m]
    assert logged and "generator/spec_acceptance_rate_0" in logged[-1]
