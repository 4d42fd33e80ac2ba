"""RLOO, PPO and Best-of-2 on the same asynchronous loop as online DPO: real generator processes (vLLM for RLOO),
shared-memory weight sync, max_staleness 0 and 2, staleness bound checked from the run's records. The runs at
max_staleness 0 are in the slow tier (`test_sync_parity.py` trains RLOO and PPO at 0 in the default tier); each run
starts only when a test asks for it."""

from __future__ import annotations

import json

import pytest
from run_records import RunsOnDemand, check_staleness_records

from async_rlhf import (
    AsyncBestOfNConfig,
    AsyncBestOfNTrainer,
    AsyncPPOConfig,
    AsyncPPOTrainer,
    AsyncRLOOConfig,
    AsyncRLOOTrainer,
)
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

STEPS = 5
LEARNERS = {
    "rloo": (AsyncRLOOTrainer, AsyncRLOOConfig, {"off_policy_correction": "tis", "per_device_train_batch_size": 8}),
    "ppo": (AsyncPPOTrainer, AsyncPPOConfig, {"off_policy_correction": "decoupled"}),
    "best_of_2": (AsyncBestOfNTrainer, AsyncBestOfNConfig, {}),
}
# the stale RLOO run samples with vLLM, the others with the transformers generator, which starts in seconds where a
# vLLM engine takes 15-25 s on 2 cores (the learners do not depend on the backend: 5 engine starts saved)
VLLM_RUN = ("rloo", 2)


def _train(tmp_path_factory, tiny_model_dir, name: str, staleness: int):
    trainer_cls, config_cls, extra = LEARNERS[name]
    d = tmp_path_factory.mktemp(f"{name}-{staleness}")
    config = config_cls(output_dir=str(d), max_steps=STEPS,
                        max_new_tokens=10, max_length=48, learning_rate=1e-2, lr_scheduler_type="constant",
                        max_staleness=staleness, disable_tqdm=True, seed=3, rollout_timeout=300,
                        generator_backend="vllm" if (name, staleness) == VLLM_RUN else "transformers",
                        **{"per_device_train_batch_size": 4, **extra})  # RLOO counts completions: 4 prompts x 2
    trainer = trainer_cls(model=tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                          train_dataset=toy_prompts(64))
    trainer.train()
    steps = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    return trainer.run_summary, [m for m in steps if "loss" in m], d


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_model_dir):
    return RunsOnDemand(lambda key: _train(tmp_path_factory, tiny_model_dir, *key))


BOTH = [pytest.param(0, marks=pytest.mark.slow), 2]


@pytest.mark.parametrize("name", list(LEARNERS))
@pytest.mark.parametrize("staleness", BOTH)
def test_runs_end_to_end_within_the_staleness_bound(results, name, staleness):
    summary, steps, out = results[name, staleness]
    assert len(steps) == STEPS
    trained = check_staleness_records(out, STEPS, staleness, summary, dropped=0)
    if staleness:
        assert max(trained) >= 1, trained  # generation really ran ahead of training


@pytest.mark.parametrize("name", ["rloo", "ppo"])
@pytest.mark.parametrize("staleness", BOTH)
def test_importance_weights_are_one_on_policy_and_not_when_stale(results, name, staleness):
    # on-policy steps: every step at S = 0, a batch of the step's own version at S = 2 (its first step at least)
    on_policy = [m for m in results[name, staleness][1] if m["queue/staleness_of_batch"] == 0]
    assert len(on_policy) >= (STEPS if staleness == 0 else 1)
    # behaviour == learner: weights are 1 up to float noise (vLLM's kernels: up to 2e-2 per token), so is their ESS
    mean_tol, max_tol = (2e-3, 2e-2) if (name, staleness) == VLLM_RUN else (1e-4, 1e-3)
    for m in on_policy:
        assert abs(m["off_policy/is_weight_mean"] - 1) < mean_tol, m
        assert abs(m["off_policy/is_weight_max"] - 1) < max_tol, m
        assert m["off_policy/is_ess"] > 1 - mean_tol, m
    if not staleness:
        return
    stale = [m for m in results[name, 2][1] if m["queue/staleness_of_batch"] >= 1]
    assert stale and max(abs(m["off_policy/is_weight_max"] - 1) for m in stale) > 1e-2
    for m in stale:  # the correction's own weights (tis / decoupled here) report theirs
        assert 0 < m["policy/is_ess"] <= 1 + 1e-6 and 0 < m["off_policy/is_ess"] <= 1 + 1e-6, m
