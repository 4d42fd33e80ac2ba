"""RLOO, PPO and Best-of-2 on the same asynchronous loop as online DPO: real generator processes (vLLM for RLOO),
shared-memory weight sync, max_staleness 0 and 2, staleness bound checked from the run's records."""

from __future__ import annotations

import json

import pytest
from run_records import check_staleness_records

from async_rlhf import (
    AsyncBestOfNConfig,
    AsyncBestOfNTrainer,
    AsyncPPOConfig,
    AsyncPPOTrainer,
    AsyncRLOOConfig,
    AsyncRLOOTrainer,
)
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

STEPS = 5
LEARNERS = {
    "rloo": (AsyncRLOOTrainer, AsyncRLOOConfig, {"off_policy_correction": "tis"}),
    "ppo": (AsyncPPOTrainer, AsyncPPOConfig, {"off_policy_correction": "decoupled"}),
    "best_of_2": (AsyncBestOfNTrainer, AsyncBestOfNConfig, {}),
}
# the stale RLOO run samples with vLLM, the others with the transformers generator, which starts in seconds where a
# vLLM engine takes 15-25 s on 2 cores (the learners do not depend on the backend: 5 engine starts saved)
VLLM_RUN = ("rloo", 2)


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    out = {}
    for name, (trainer_cls, config_cls, extra) in LEARNERS.items():
        for staleness in (0, 2):
            d = tmp_path_factory.mktemp(f"{name}-{staleness}")
            config = config_cls(output_dir=str(d), max_steps=STEPS, per_device_train_batch_size=4,
                                max_new_tokens=10, max_length=48, learning_rate=1e-2, lr_scheduler_type="constant",
                                max_staleness=staleness, disable_tqdm=True, seed=3, rollout_timeout=300,
                                generator_backend="vllm" if (name, staleness) == VLLM_RUN else "transformers",
                                **extra)
            trainer = trainer_cls(model=tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                                  train_dataset=toy_prompts(64))
            trainer.train()
            steps = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
            out[name, staleness] = (trainer.run_summary, [m for m in steps if "loss" in m], d)
    return out


@pytest.mark.parametrize("name", list(LEARNERS))
@pytest.mark.parametrize("staleness", [0, 2])
def test_runs_end_to_end_within_the_staleness_bound(results, name, staleness):
    summary, steps, out = results[name, staleness]
    assert len(steps) == STEPS
    trained = check_staleness_records(out, STEPS, staleness, summary, dropped=0)
    if staleness:
        assert max(trained) >= 1, trained  # generation really ran ahead of training


@pytest.mark.parametrize("name", ["rloo", "ppo"])
def test_importance_weights_are_one_on_policy_and_not_when_stale(results, name):
    on_policy = results[name, 0][1]
    for m in on_policy:  # behaviour == learner: weights are 1 up to float noise, so is their effective sample size
        assert abs(m["off_policy/is_weight_mean"] - 1) < 1e-4, m
        assert abs(m["off_policy/is_weight_max"] - 1) < 1e-3, m
        assert m["off_policy/is_ess"] > 1 - 1e-4, m
    stale = [m for m in results[name, 2][1] if m["queue/staleness_of_batch"] >= 1]
    assert stale and max(abs(m["off_policy/is_weight_max"] - 1) for m in stale) > 1e-2
    for m in stale:  # the correction's own weights (tis / decoupled here) report theirs
        assert 0 < m["policy/is_ess"] <= 1 + 1e-6 and 0 < m["off_policy/is_ess"] <= 1 + 1e-6, m
