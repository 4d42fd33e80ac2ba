"""`num_iterations` (optimizer passes per batch) is checked before anything starts: at least 1, and not under
DeepSpeed, whose engine steps inside backward (`trainers/base.py::further_passes` steps the optimizer itself)."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncPPOConfig, AsyncRLOOConfig, AsyncRLOOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.errors import ConfigError


def test_passes_are_at_least_one(tmp_path):
    with pytest.raises(ConfigError, match="^num_iterations: must be >= 1, got 0"):
        AsyncPPOConfig(output_dir=str(tmp_path), num_iterations=0)
    assert AsyncPPOConfig(output_dir=str(tmp_path), num_iterations=3).num_iterations == 3  # PPO takes it too


def test_several_passes_are_refused_under_deepspeed_before_a_model_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    args = AsyncRLOOConfig(output_dir=str(tmp_path), num_iterations=2, per_device_train_batch_size=4,
                           num_generations=2, generator_backend="transformers")
    with pytest.raises(ConfigError, match="^num_iterations: 2 passes per batch are not built under DeepSpeed"):
        AsyncRLOOTrainer(model=str(tmp_path / "no-such-model"), reward_funcs=lowercase_reward, args=args,
                         train_dataset=toy_prompts(8))
