"""A real run (tiny model, one CPU generator) whose loss is NaN on chosen steps: those steps leave the policy as it
was, are counted in learner/nonfinite_steps, and too many in a row end the run with a checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import TrainerCallback

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.learner.checkpointing import latest_complete_checkpoint
from async_rlhf.learner.nonfinite import NonFiniteSteps

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them


class NaNLossTrainer(AsyncOnlineDPOTrainer):
    """Online DPO whose loss is multiplied by NaN on the steps in `nan_steps` (the algorithm hook, nothing else)."""

    nan_steps: set[int] = set()

    def compute_rollout_loss(self, model, groups, kept=None):
        loss, metrics = super().compute_rollout_loss(model, groups, kept)
        return (loss * math.nan if self.state.global_step in self.nan_steps else loss), metrics


class WeightsPerStep(TrainerCallback):
    def __init__(self):
        self.before, self.changed = None, {}

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.before = [p.detach().clone() for p in model.parameters()]

    def on_step_end(self, args, state, control, model=None, **kw):
        self.changed[state.global_step - 1] = any(not torch.equal(a, p) for a, p in zip(self.before, model.parameters()))


def config(out, **kw):
    return AsyncOnlineDPOConfig(**{**dict(
        output_dir=str(out), max_steps=4, per_device_train_batch_size=2, num_generations=2, max_new_tokens=6,
        max_length=48, learning_rate=5e-3, lr_scheduler_type="constant", generator_backend="transformers",
        disable_tqdm=True, seed=5, generator_start_timeout=120, rollout_timeout=120, save_strategy="no"), **kw})


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tmp_path, tiny_model_dir):
    out = tmp_path / "skip"
    trainer = NaNLossTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config(out),
                             train_dataset=toy_prompts(64, seed=5))
    trainer.nan_steps = {1, 2}
    weights = WeightsPerStep()
    trainer.add_callback(weights)
    trainer.train()
    assert weights.changed == {0: True, 1: False, 2: False, 3: True}
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    logs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    counts = [r["learner/nonfinite_steps"] for r in logs if "learner/nonfinite_steps" in r]
    assert counts == [0.0, 1.0, 2.0, 2.0], counts

    out = tmp_path / "stop"
    trainer = NaNLossTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config(out, max_nonfinite_steps=1),
                             train_dataset=toy_prompts(64, seed=5))
    trainer.nan_steps = {1, 2, 3}
    with pytest.raises(NonFiniteSteps) as info:
        trainer.train()
    message = str(info.value)
    assert "learner: 2 optimizer steps in a row had a non-finite loss" in message, message
    assert "more than max_nonfinite_steps=1" in message, message
    assert f"Saved {out / 'checkpoint-2'} at step 2" in message, message  # steps 0 (trained) and 1 (skipped)
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-2")
