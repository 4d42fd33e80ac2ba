"""TRL 1.16's RLOOTrainer / RLOOConfig where our RLOO shares a field or a behaviour with it (huggingface/trl
tests/test_rloo_trainer.py's cases of that kind), against TRL's classes (the control) and ours imported under TRL's
names. The models and prompts are `tests/compat/conftest.py`'s; the scoring path (TRL's reward-function arguments, None
as NaN) is the one GRPO's default-tier training checks.

Default tier: the config and construction cases (no training). The trainings (upstream's test_train with a reward model,
conversational reward functions with a None output, reward clipping and normalised advantages) are `slow`: RLOO's
training is default-tier in tests/integration (test_sync_parity.py, test_policy_gradient_learners.py).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

pytestmark = pytest.mark.integration

IMPLS = ["trl", "ours"]
TRL_FIELDS = dict(learning_rate=0.1, per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
                  report_to="none", max_steps=2, bf16=False, logging_steps=1, seed=0)
OURS = dict(disable_tqdm=True, generator_start_timeout=120, rollout_timeout=120)


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def none_reward(completions, **kwargs):
    return [None] * len(completions)


def _train_and_check(trainer) -> list[dict]:
    """Upstream's checks: the run ends with its `train_loss`, and every parameter moved. Returns the step logs."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for name, p in trainer.model.named_parameters():
        if name in before:
            assert not torch.equal(p.detach(), before[name]), f"parameter {name} has not changed"
    return [entry for entry in trainer.state.log_history if "train_loss" not in entry]


def _classes(impl: str):
    if impl == "trl":
        from trl import RLOOConfig, RLOOTrainer
    else:
        from async_rlhf import AsyncRLOOConfig as RLOOConfig
        from async_rlhf import AsyncRLOOTrainer as RLOOTrainer
    return RLOOConfig, RLOOTrainer


def _trainer(impl: str, tmp_path, fields: dict, **kwargs):
    RLOOConfig, RLOOTrainer = _classes(impl)
    args = RLOOConfig(output_dir=str(tmp_path), **{**TRL_FIELDS, **fields}, **(OURS if impl == "ours" else {}))
    return RLOOTrainer(args=args, **kwargs)


@pytest.mark.parametrize("impl", IMPLS)
def test_defaults_batch_semantics_and_trls_config_errors(impl, tmp_path):
    RLOOConfig, _ = _classes(impl)
    c = RLOOConfig(output_dir=str(tmp_path), bf16=False)
    assert (c.num_generations, c.beta, c.max_completion_length, c.learning_rate, c.temperature) == (2, 0.05, 512,
                                                                                                     1e-6, 1.0)
    assert (c.normalize_advantages, c.reward_clip_range, c.mask_truncated_completions, c.num_iterations) == (
        False, None, False, 1)
    assert (c.generation_batch_size, c.steps_per_generation) == (8, 1)  # 8 completions: 4 prompts x 2
    for fields, message in [
            ({"per_device_train_batch_size": 3}, r"generation_batch_size \(3\) must be divisible by num_generations"),
            ({"per_device_train_batch_size": 8, "generation_batch_size": 12},
             r"generation_batch_size \(12\) must be divisible by the global batch size \(8\)"),
            ({"generation_batch_size": 16, "steps_per_generation": 2}, "can not be both configured"),
            ({"num_generations": 1}, "RLOO requires at least 2 generations per prompt"),
            ({"auto_find_batch_size": True}, "auto_find_batch_size is not supported by RLOO")]:
        with pytest.raises(ValueError, match=message):
            RLOOConfig(output_dir=str(tmp_path), bf16=False, **fields)


@pytest.mark.parametrize("impl", IMPLS)
def test_mismatched_reward_processing_classes_and_attributes(impl, compat_dirs, zen_prompts, models, tmp_path):
    with pytest.raises(ValueError, match="must match"):
        _trainer(impl, tmp_path, {}, model=compat_dirs["policy"], reward_funcs=[compat_dirs["reward"]] * 2,
                 reward_processing_classes=models.reward_tokenizer, train_dataset=zen_prompts("standard_prompt_only"))
    trainer = _trainer(impl, tmp_path, {"reward_weights": [2.0, 1.0]}, model=compat_dirs["policy"],
                       reward_funcs=[length_reward, none_reward], train_dataset=zen_prompts("standard_prompt_only"))
    assert trainer.reward_func_names == ["length_reward", "none_reward"]
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    assert trainer.num_generations == 3 and trainer.beta == 0.05
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.2)


def test_every_trl_config_field_is_accepted_and_no_ops_are_named_once(tmp_path, caplog):
    from trl import RLOOConfig

    from async_rlhf import AsyncRLOOConfig

    assert not {f.name for f in dataclasses.fields(RLOOConfig)} - {f.name for f in dataclasses.fields(AsyncRLOOConfig)}
    no_ops = dict(shuffle_dataset=False, log_completions=True, num_generations_eval=4)
    with caplog.at_level(logging.WARNING, logger="async_rlhf.config.trl_fields"):
        AsyncRLOOConfig(output_dir=str(tmp_path), reward_clip_range=[-1.0, 1.0], mask_truncated_completions=True,
                        **no_ops)
    lines = [r.getMessage() for r in caplog.records if r.name == "async_rlhf.config.trl_fields"]
    assert len(lines) == 1 and all(name in lines[0] for name in no_ops), lines
    assert "reward_clip_range" not in lines[0] and "mask_truncated_completions" not in lines[0]  # applied here


def test_ours_refuses_what_it_does_not_build(compat_dirs, zen_prompts, tmp_path):
    """Ours only: TRL's constructor signature, then GRPO's multi-turn arguments (ours only); asymmetric clipping is not
    built for RLOO (TRL takes epsilon_high)."""
    import inspect

    from trl import RLOOTrainer

    from async_rlhf import AsyncRLOOTrainer
    from async_rlhf.errors import ConfigError

    assert list(inspect.signature(AsyncRLOOTrainer).parameters) == [*inspect.signature(RLOOTrainer).parameters,
                                                                      "tools", "environment_factory"]

    with pytest.raises(ConfigError, match="epsilon_high: 0.28"):
        _trainer("ours", tmp_path, {"epsilon_high": 0.28}, model=compat_dirs["policy"], reward_funcs=length_reward,
                 train_dataset=zen_prompts("standard_prompt_only"))


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_train_reward_model(impl, compat_dirs, zen_prompts, tmp_path):
    """Upstream's test_train."""
    trainer = _trainer(impl, tmp_path, {}, model=compat_dirs["policy"], reward_funcs=compat_dirs["reward"],
                       train_dataset=zen_prompts("standard_prompt_only"))
    _train_and_check(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
# the clip range leaves the tiny policy's rewards (distinct characters of 8 tokens) as they are: a tighter one makes a
# group's rewards equal, and nothing moves in either trainer
@pytest.mark.parametrize("fields", [{}, {"reward_clip_range": [0.0, 100.0], "normalize_advantages": True}])
def test_train_conversational_with_a_none_output(impl, fields, compat_dirs, zen_prompts, tmp_path):
    """Upstream's test_train_reward_func_conversational and ..._with_None_output; clipping and normalisation."""
    def content_length(completions, **kwargs):  # distinct characters: the tiny policy's lengths barely vary
        return [float(len(set(c[0]["content"]))) for c in completions]

    trainer = _trainer(impl, tmp_path, fields, model=compat_dirs["policy"], reward_funcs=[content_length, none_reward],
                       train_dataset=zen_prompts("conversational_prompt_only"))
    steps = _train_and_check(trainer)
    assert {"reward", "reward_std", "entropy", "num_tokens", "completions/mean_length", "kl", "clip_ratio/low_mean",
            "clip_ratio/high_max", "clip_ratio/region_mean", "rewards/content_length/mean"} <= set().union(*steps)
