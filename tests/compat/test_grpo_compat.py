"""Compatibility cases written from TRL 1.16's GRPO trainer tests (tests/test_grpo_trainer.py upstream): each case
trains TRL's `GRPOTrainer` (the control) and our `AsyncGRPOTrainer` with the same TRL config fields and checks what
TRL's test checks: the run ends with a `train_loss` and every parameter of the policy moved.

Upstream uses hub models (tiny Qwen2 policy, tiny reward model) and the `trl-internal-testing/zen` prompts; here
the policy is the local tiny Llama with the char tokenizer (`tiny_model_dir`), the prompts `toy_prompts` and the
reward a function (no hub). What our trainer is given on top of TRL's fields, and why:
- `per_device_train_batch_size` counts prompts here, completions in TRL's GRPO: ours gets TRL's value divided by
  `num_generations` (the same completions per micro-batch);
- `max_length` (prompt + completion, TRL has no such field; our default 512 exceeds the tiny model's 256
  positions), `generator_backend="transformers"` (starts in seconds on CPU) and short timeouts.
Two cheap cases run in the default tier, the rest are `slow`. Every case trains, so the file is marked `integration`
(`-m "not integration"` stays the unit tier).
"""

from __future__ import annotations

import math

import pytest
import torch

from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

pytestmark = pytest.mark.integration

IMPLS = ["trl", "ours"]
COMMON = dict(learning_rate=0.1, per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
              max_steps=2, report_to="none", seed=0)
OURS_ONLY = dict(max_length=64, generator_backend="transformers", disable_tqdm=True, generator_start_timeout=120,
                 rollout_timeout=120)


def length_reward(prompts, completions, **kwargs) -> list[float]:
    return [len(c) / 8.0 for c in completions]


def column_reward(prompts, completions, some_values, **kwargs) -> list[float]:
    """Reads a dataset column, as upstream's test_training_with_additional_columns."""
    return [float(v) * sum(ch in "aeiou" for ch in c) for v, c in zip(some_values, completions)]


def _dataset(extra_column: bool = False):
    data = toy_prompts(24)
    if extra_column:
        data = data.add_column("some_values", [(i % 3) + 1 for i in range(len(data))])
    return data


# case name -> (config fields for both trainers, reward_funcs, dataset uses an extra column, parameters must move)
CASES = {
    "training": ({}, lowercase_reward, False, True),
    "beta_non_zero": ({"beta": 0.1}, lowercase_reward, False, True),
    **{f"loss_type_{t}": ({"loss_type": t, "gradient_accumulation_steps": 2}, lowercase_reward, False, True)
       for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")},
    "multiple_reward_funcs_with_weights": ({"reward_weights": [0.7, 0.3]}, [lowercase_reward, length_reward],
                                           False, True),
    "additional_columns": ({}, column_reward, True, True),
    "scale_rewards_batch": ({"scale_rewards": "batch"}, lowercase_reward, False, True),
    "scale_rewards_false": ({"scale_rewards": False}, lowercase_reward, False, True),
    "delta_clipping": ({"delta": 2.0}, lowercase_reward, False, True),
    "epsilon_high": ({"epsilon_high": 0.28}, lowercase_reward, False, True),
    "sequence_importance_sampling": ({"importance_sampling_level": "sequence", "loss_type": "grpo"},
                                     lowercase_reward, False, True),
    # the tiny random policy rarely ends before 8 tokens, so most completions are masked: only the run is checked
    "mask_truncated_completions": ({"mask_truncated_completions": True}, lowercase_reward, False, False),
}
CHEAP = {"training", "beta_non_zero"}


def _train(impl: str, fields: dict, reward_funcs, dataset, model_dir: str, output_dir: str):
    fields = {**COMMON, **fields, "output_dir": output_dir}
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**fields, bf16=False)
        trainer = GRPOTrainer(model=model_dir, reward_funcs=reward_funcs, args=args, train_dataset=dataset)
    else:
        from async_rlhf import AsyncGRPOConfig, AsyncGRPOTrainer

        args = AsyncGRPOConfig(**fields, **OURS_ONLY)
        trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=reward_funcs, args=args, train_dataset=dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer, before


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [c if c in CHEAP else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_grpo_case(case, impl, tiny_model_dir, tmp_path):
    fields, reward_funcs, extra_column, must_move = CASES[case]
    trainer, before = _train(impl, fields, reward_funcs, _dataset(extra_column), tiny_model_dir, str(tmp_path))
    train_loss = trainer.state.log_history[-1]["train_loss"]
    assert train_loss is not None and math.isfinite(train_loss)
    if must_move:
        for name, param in trainer.model.named_parameters():
            assert not torch.equal(param.detach(), before[name]), f"{impl}: parameter {name} has not changed"


@pytest.mark.parametrize("impl", IMPLS)
def test_public_attributes_after_construction(impl, tiny_model_dir, tmp_path):
    """The attributes TRL users read after construction, on both classes (no training)."""
    fields = {**COMMON, "output_dir": str(tmp_path), "reward_weights": [2.0, 1.0], "beta": 0.0}
    funcs = [lowercase_reward, length_reward]
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=funcs, args=GRPOConfig(**fields, bf16=False),
                              train_dataset=_dataset())
    else:
        from async_rlhf import AsyncGRPOConfig, AsyncGRPOTrainer

        args = AsyncGRPOConfig(**fields, **OURS_ONLY)
        trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=funcs, args=args, train_dataset=_dataset())
    assert trainer.reward_funcs == funcs
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    assert trainer.num_generations == 3 and trainer.beta == 0.0
    assert trainer.loss_type == "dapo" and trainer.scale_rewards == "group"
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.2)
    assert trainer.max_completion_length == 8
