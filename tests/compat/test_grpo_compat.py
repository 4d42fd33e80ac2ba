"""TRL 1.16's GRPO trainer tests (huggingface/trl tests/test_grpo_trainer.py), rewritten with local tiny models, each
run against TRL's `GRPOTrainer` (the control) and our `AsyncGRPOTrainer` with the same TRL fields: a TRL script switched
by one import. A case passes for both or the drop-in is broken.

Upstream uses hub models (tiny Qwen2 policy, tiny sequence-classification reward models) and the
`trl-internal-testing/zen` prompts; here the tiny Llama policy and reward model of `compat_dirs` (conftest.py) and the
zen prompts built locally, in TRL's two formats. Every case sets `max_steps` (upstream trains the whole 17-row set),
`bf16=False` (CPU) and, for ours, short timeouts (`OURS`): nothing else differs between the two calls. Not rewritten:
vLLM, PEFT, Liger, vision-language, tools / environments, entropy masking and bonus and the 'vespo' loss (our config
accepts their fields and names them in one warning; tested below), iterable datasets and evaluation during training.

Default tier: one training per class checking several of upstream's cases at once (conversational prompts and
message-list arguments, a reward model with its own chat template, a function reading an extra column, `trainer_state`
and `log_metric`, a function returning None, reward weights and the logged reward, beta > 0, TRL's metric names), the
construction and config cases, and ours' refusals. The cases upstream has one by one (text prompts with a reward model
by path, loss types, reward scaling, clipping, masking, ...) train in the `slow` tier. The file is marked `integration`
(`-m "not integration"` stays the unit tier).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

pytestmark = pytest.mark.integration

IMPLS = ["trl", "ours"]
# upstream's fields ("reduce ... to reduce memory usage"), max_steps and CPU float32 on top
TRL_FIELDS = dict(learning_rate=0.1, per_device_train_batch_size=3, num_generations=3, max_completion_length=8,
                  report_to="none", max_steps=2, bf16=False, logging_steps=1, seed=0)
OURS = dict(disable_tqdm=True, generator_start_timeout=120, rollout_timeout=120)  # ours only: fail fast if stuck
# what TRL 1.16's GRPOTrainer logs every step with beta != 0 and a clipping loss type (besides reward names)
TRL_METRICS = {"num_tokens", "completions/mean_length", "completions/min_length", "completions/max_length",
               "completions/clipped_ratio", "completions/mean_terminated_length",
               "completions/min_terminated_length", "completions/max_terminated_length", "reward", "reward_std",
               "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min",
               "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean"}


def _classes(impl: str):
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from async_rlhf import AsyncGRPOConfig as GRPOConfig
        from async_rlhf import AsyncGRPOTrainer as GRPOTrainer
    return GRPOConfig, GRPOTrainer


def _trainer(impl: str, tmp_path, fields: dict, **kwargs):
    GRPOConfig, GRPOTrainer = _classes(impl)
    extra = OURS if impl == "ours" else {}
    args = GRPOConfig(output_dir=str(tmp_path), **{**TRL_FIELDS, **fields}, **extra)
    return GRPOTrainer(args=args, **kwargs)


def _train_and_check(trainer, params_move: bool = True) -> list[dict]:
    """Upstream's checks: the run ends with its `train_loss`, and every parameter moved. Returns the step logs."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    if params_move:
        for name, p in trainer.model.named_parameters():
            if name in before:
                assert not torch.equal(p.detach(), before[name]), f"parameter {name} has not changed"
    return [entry for entry in trainer.state.log_history if "train_loss" not in entry]


# ---- reward functions of upstream's cases ---------------------------------------------------------------------------
def column_reward(prompts, completions, some_values, trainer_state=None, log_metric=None, **kwargs):
    """Upstream's additional column, trainer_state, log_metric and conversational reward functions in one:
    conversational prompts and completions arrive as message lists."""
    assert trainer_state is not None and hasattr(trainer_state, "global_step")
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
    assert all(c[0]["role"] == "assistant" for c in completions)
    log_metric("custom_accuracy", 0.75)
    return [float(v) * len(c[0]["content"]) for v, c in zip(some_values, completions)]


def text_reward(prompts, completions, some_values, **kwargs):
    """Standard data: prompts and completions are text, columns by name."""
    assert all(isinstance(p, str) for p in prompts) and all(isinstance(c, str) for c in completions)
    return [float(v) * len(c) for v, c in zip(some_values, completions)]


def none_reward(completions, **kwargs):
    """test_train_multiple_reward_funcs_with_None_output: a function that applies to no sample."""
    return [None] * len(completions)


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def distinct_reward(completions, **kwargs):
    """Upstream's reward of test_train_with_reward_func_accessing_trainer_state: distinct characters. (The tiny
    random policy rarely ends within 8 tokens, so lengths barely vary; a group of equal rewards moves nothing.)"""
    return [float(len(set(c))) for c in completions]


def _standard(zen_prompts):
    data = zen_prompts("standard_prompt_only")
    return data.add_column("some_values", [float(i % 3 + 1) for i in range(len(data))])


# ---- default tier: one training per class ---------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_train_conversational_reward_model_columns_state_none_weights_beta_and_metric_names(impl, compat_dirs, models,
                                                                                             zen_prompts, tmp_path):
    """Upstream's test_train_reward_func_conversational (message-list arguments), test_train_different_reward_model
    (a reward model with its own tokenizer and chat template), ..._reward_func_additional_column,
    ..._with_reward_func_accessing_trainer_state, ..._reward_func_with_log_metric,
    ..._multiple_reward_funcs_with_None_output, test_reward_metric_reflects_reward_weights (the logged `reward` is
    the weighted sum; None adds nothing) and test_train_beta_non_zero, with TRL's metric names, in one run."""
    data = zen_prompts("conversational_prompt_only")
    data = data.add_column("some_values", [float(i % 3 + 1) for i in range(len(data))])
    trainer = _trainer(impl, tmp_path, {"reward_weights": [0.7, 0.3, 1.0], "beta": 0.1}, model=compat_dirs["policy"],
                       reward_funcs=[models.reward_model, column_reward, none_reward],
                       reward_processing_classes=[models.reward_tokenizer, None, None], train_dataset=data)
    steps = _train_and_check(trainer)
    assert trainer.ref_model is not None and trainer.beta == 0.1
    names = trainer.reward_func_names
    assert names == ["reward", "column_reward", "none_reward"]
    logged = set().union(*steps)
    missing = TRL_METRICS - logged
    assert not missing, f"{impl}: {sorted(missing)} not logged"
    for name in names:
        assert {f"rewards/{name}/mean", f"rewards/{name}/std"} <= logged
    assert "custom_accuracy" in logged
    last = steps[-1]
    weighted = 0.7 * last["rewards/reward/mean"] + 0.3 * last["rewards/column_reward/mean"]
    assert math.isclose(last["reward"], weighted, rel_tol=1e-4, abs_tol=1e-4), (impl, last["reward"], weighted)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_train_standard_reward_model_by_path(impl, compat_dirs, zen_prompts, tmp_path):
    """Upstream's test_train: text prompts, a reward model given by its path; functions get text."""
    trainer = _trainer(impl, tmp_path, {}, model=compat_dirs["policy"],
                       reward_funcs=[compat_dirs["reward"], text_reward], train_dataset=_standard(zen_prompts))
    _train_and_check(trainer)


# ---- default tier: construction, config and refusal cases (no training) --------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_mismatched_reward_processing_classes_length(impl, compat_dirs, zen_prompts, models, tmp_path):
    """One tokenizer given for two reward models is a ValueError; one for one reward model is kept in a list."""
    with pytest.raises(ValueError, match="must match"):
        _trainer(impl, tmp_path, {}, model=compat_dirs["policy"], reward_funcs=[compat_dirs["reward"]] * 2,
                 reward_processing_classes=models.reward_tokenizer, train_dataset=zen_prompts("standard_prompt_only"))
    trainer = _trainer(impl, tmp_path, {}, model=compat_dirs["policy"], reward_funcs=compat_dirs["reward"],
                       reward_processing_classes=models.reward_tokenizer,
                       train_dataset=zen_prompts("standard_prompt_only"))
    assert len(trainer.reward_processing_classes) == 1
    assert trainer.reward_processing_classes[0] == models.reward_tokenizer


@pytest.mark.parametrize("impl", IMPLS)
def test_batch_semantics_and_trls_config_errors(impl, tmp_path):
    """Batch sizes count completions: generation_batch_size derives from them and must hold whole prompt groups,
    with TRL's messages."""
    GRPOConfig, _ = _classes(impl)
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                        gradient_accumulation_steps=2, bf16=False)
    assert (config.generation_batch_size, config.steps_per_generation) == (16, 2)
    config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                        generation_batch_size=12, bf16=False)
    assert config.steps_per_generation == 3
    for fields, message in [
            ({"per_device_train_batch_size": 3, "num_generations": 2},
             r"generation_batch_size \(3\) must be divisible by num_generations \(2\)"),
            ({"per_device_train_batch_size": 8, "generation_batch_size": 12},
             r"generation_batch_size \(12\) must be divisible by the global batch size \(8\)"),
            ({"generation_batch_size": 16, "steps_per_generation": 2}, "can not be both configured"),
            ({"num_generations": 1, "per_device_train_batch_size": 2}, "requires at least 2 generations"),
            ({"auto_find_batch_size": True}, "auto_find_batch_size is not supported by GRPO"),
            ({"log_completions_hub_repo": "me/x"}, "log_completions_hub_repo is set, but log_completions is False"),
            ({"vllm_importance_sampling_clip_min": 3.0}, "must be less than vllm_importance_sampling_clip_max")]:
        with pytest.raises(ValueError, match=message):
            GRPOConfig(output_dir=str(tmp_path), bf16=False, **fields)


@pytest.mark.parametrize("impl", IMPLS)
def test_trls_defaults(impl, tmp_path):
    GRPOConfig, _ = _classes(impl)
    c = GRPOConfig(output_dir=str(tmp_path), bf16=False)
    assert (c.max_completion_length, c.num_generations, c.beta, c.loss_type, c.scale_rewards) == (512, 8, 0.0,
                                                                                                  "dapo", "group")
    assert (c.learning_rate, c.temperature, c.epsilon, c.epsilon_high, c.num_iterations) == (1e-6, 1.0, 0.2, None, 1)
    assert (c.importance_sampling_level, c.multi_objective_aggregation) == ("token", "sum_then_normalize")
    assert (c.mask_truncated_completions, c.use_bias_correction_kl, c.pad_to_multiple_of) == (False, True, None)
    assert (c.generation_batch_size, c.steps_per_generation) == (8, 1)


def test_every_trl_config_field_is_accepted_and_no_ops_are_named_once(tmp_path, caplog):
    """Every field of TRL's GRPOConfig is a field of ours; those with nothing to act on here, set to anything but
    TRL's default, are named in one warning (config/trl_fields.py)."""
    from trl import GRPOConfig

    from async_rlhf import AsyncGRPOConfig

    assert not {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    no_ops = dict(shuffle_dataset=False, log_completions=True, num_completions_to_print=2,
                  entropy_coef=0.01, top_entropy_quantile=0.5, cast_lm_head_to_fp32=True, num_generations_eval=4,
                  vllm_importance_sampling_correction=False,
                  off_policy_mask_threshold=0.5, vespo_k_pos=1.0)  # (TRL's continuous batching is mapped)
    with caplog.at_level(logging.WARNING, logger="async_rlhf.config.trl_fields"):
        config = AsyncGRPOConfig(output_dir=str(tmp_path), vllm_max_model_length=256, **no_ops)
    lines = [r.getMessage() for r in caplog.records if r.name == "async_rlhf.config.trl_fields"]
    assert len(lines) == 1, lines
    for name in no_ops:
        assert name in lines[0]
    assert config.vllm_max_model_len == 256  # mapped, not a no-op
    assert "vllm_max_model_length" not in lines[0]


def test_ours_steps_per_generation_is_num_mini_batches_and_whole_groups_per_micro_batch(tmp_path):
    """Ours only. TRL's steps_per_generation = 2 x gradient_accumulation_steps trains two steps on one policy's
    completions: num_mini_batches 2 here. A micro-batch here holds whole prompt groups: upstream's
    test_train_num_generations_larger_than_batch_size (3 completions a micro-batch, groups of 6) is refused with
    the fix in the message."""
    from async_rlhf import AsyncGRPOConfig
    from async_rlhf.errors import ConfigError

    c = AsyncGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                        steps_per_generation=2)
    assert (c.num_mini_batches, c.sync_every, c.max_staleness, c.prompts_per_step) == (2, 2, 1, 1)
    with pytest.raises(ConfigError, match="per_device_train_batch_size: 3 completions is not a multiple of "
                                          r"num_generations \(6\)"):
        AsyncGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=3, num_generations=6,
                        gradient_accumulation_steps=2)
    both = AsyncGRPOConfig(output_dir=str(tmp_path), max_completion_length=8, max_new_tokens=9)  # TRL's name wins
    assert both.max_new_tokens == both.max_completion_length == 8


def test_ours_takes_trls_constructor_arguments_and_refuses_the_unbuilt_ones(compat_dirs, zen_prompts, tmp_path):
    """Ours only: TRL 1.16 GRPOTrainer's signature, in its order; what is not built here fails naming it."""
    import inspect

    from trl import GRPOTrainer

    from async_rlhf import AsyncGRPOTrainer
    from async_rlhf.errors import ConfigError

    assert list(inspect.signature(AsyncGRPOTrainer).parameters) == list(inspect.signature(GRPOTrainer).parameters)
    with pytest.raises(ConfigError, match="^rollout_func: not built"):
        _trainer("ours", tmp_path, {}, model=compat_dirs["policy"], reward_funcs=length_reward,
                 rollout_func=lambda prompts, trainer: {}, train_dataset=zen_prompts("standard_prompt_only"))
    with pytest.raises(ConfigError, match="object has no `reset` method"):  # multi-turn: tests/compat/test_grpo_tools_compat.py
        _trainer("ours", tmp_path, {}, model=compat_dirs["policy"], reward_funcs=length_reward,
                 environment_factory=object, train_dataset=zen_prompts("standard_prompt_only"))


@pytest.mark.parametrize("impl", IMPLS)
def test_public_attributes_after_construction(impl, compat_dirs, zen_prompts, tmp_path):
    """The attributes TRL users read after construction, on both classes (no training)."""
    funcs = [length_reward, none_reward]
    trainer = _trainer(impl, tmp_path, {"reward_weights": [2.0, 1.0]}, model=compat_dirs["policy"],
                       reward_funcs=funcs, train_dataset=zen_prompts("standard_prompt_only"))
    assert trainer.reward_funcs == funcs and trainer.reward_func_names == ["length_reward", "none_reward"]
    assert trainer.reward_weights.tolist() == [2.0, 1.0]
    assert trainer.num_generations == 3 and trainer.beta == 0.0 and trainer.num_iterations == 1
    assert trainer.loss_type == "dapo" and trainer.scale_rewards == "group"
    assert (trainer.epsilon_low, trainer.epsilon_high) == (0.2, 0.2)
    assert trainer.max_completion_length == 8 and trainer.mask_truncated_completions is False


# ---- slow tier: upstream's one-option training cases ---------------------------------------------------------------
CASES = {
    **{f"loss_type_{t}": {"loss_type": t} for t in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")},
    "scale_rewards_batch": {"scale_rewards": "batch"},
    "scale_rewards_none": {"scale_rewards": "none"},
    "scale_rewards_false": {"scale_rewards": False},
    "delta_clipping": {"delta": 2.0},
    "epsilon_high": {"epsilon_high": 0.28},
    "sequence_importance_sampling": {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    "bias_correction_kl_off": {"beta": 0.1, "use_bias_correction_kl": False},
    "gradient_accumulation": {"per_device_train_batch_size": 6, "gradient_accumulation_steps": 2},
    "sync_ref_model": {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5},
}


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_train_one_option(case, impl, compat_dirs, zen_prompts, tmp_path):
    trainer = _trainer(impl, tmp_path, CASES[case], model=compat_dirs["policy"], reward_funcs=distinct_reward,
                       train_dataset=zen_prompts("standard_prompt_only"))
    _train_and_check(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_train_with_mask_truncated_completions(impl, compat_dirs, zen_prompts, tmp_path):
    """Upstream mocks generation so that some completions end; the tiny random policy rarely ends within 8 tokens,
    so most completions are masked here and only the run is checked."""
    trainer = _trainer(impl, tmp_path, {"mask_truncated_completions": True}, model=compat_dirs["policy"],
                       reward_funcs=length_reward, train_dataset=zen_prompts("standard_prompt_only"))
    _train_and_check(trainer, params_move=False)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_warning_raised_all_rewards_none(impl, compat_dirs, zen_prompts, tmp_path, caplog):
    trainer = _trainer(impl, tmp_path, {}, model=compat_dirs["policy"], reward_funcs=none_reward,
                       train_dataset=zen_prompts("standard_prompt_only"))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text


@pytest.mark.slow
def test_trl_trains_more_generations_than_a_micro_batch_holds(compat_dirs, zen_prompts, tmp_path):
    """The control of ours' refusal above: TRL's test_train_num_generations_larger_than_batch_size."""
    trainer = _trainer("trl", tmp_path, {"num_generations": 6, "gradient_accumulation_steps": 2},
                       model=compat_dirs["policy"], reward_funcs=distinct_reward,
                       train_dataset=zen_prompts("standard_prompt_only"))
    _train_and_check(trainer)
