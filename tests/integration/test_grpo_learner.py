"""GRPO on the asynchronous loop: a real generator process on the GSM8k fixture with the exact-match reward (the
verifiable-reward path: loader, `final_answer` column, reward weights), and, offline, that the exact-match reward
steers GRPO's update toward the correct answer."""

from __future__ import annotations

import json
import os

import pytest
import torch
from run_records import check_staleness_records

from async_rlhf import AsyncGRPOConfig, AsyncGRPOTrainer
from async_rlhf.data.loaders import GSM8K, gsm8k_reward, load_prompt_dataset
from async_rlhf.learner.logprobs import completion_batch, token_logps
from async_rlhf.scoring.rewards import score_rows
from async_rlhf.types import Completion, RolloutBatch

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "datasets", "gsm8k.jsonl")
STEPS = 4


def digit_reward(prompts, completions, **kwargs) -> list[float]:
    """A shaping reward next to the exact match: the fraction of digits in the completion."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def test_grpo_on_gsm8k_fixture_end_to_end(tmp_path, tiny_model_dir):
    rows = load_prompt_dataset(GSM8K, data_files=FIXTURE)
    config = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=8,
                             num_generations=4, max_completion_length=8, max_length=160, learning_rate=1e-2,
                             lr_scheduler_type="constant", max_staleness=1, generator_backend="transformers",
                             off_policy_correction="tis", beta=0.04, reward_weights=[1.0, 0.5], seed=5,
                             disable_tqdm=True, generator_start_timeout=120, rollout_timeout=120)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=[gsm8k_reward, digit_reward], args=config,
                               train_dataset=rows)
    assert trainer.reward_funcs == [gsm8k_reward, digit_reward] and trainer.num_generations == 4
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "policy/loss" in m]
    assert len(steps) == STEPS
    check_staleness_records(tmp_path, STEPS, 1, trainer.run_summary, dropped=0)
    for m in steps:
        exact, digits = m["rewards/gsm8k_reward/mean"], m["rewards/digit_reward/mean"]
        assert 0.0 <= exact <= 1.0 and 0.0 <= digits <= 1.0
        assert m["reward"] == pytest.approx(exact + 0.5 * digits, abs=1e-5)  # reward_weights combine them
        assert 0.0 <= m["frac_reward_zero_std"] <= 1.0 and m["policy/kl"] >= 0.0
        assert all(map(torch.isfinite, map(torch.tensor, (m["loss"], m["grad_norm"]))))
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "no parameter moved"


def _trainer_and_groups(tmp_path, model_dir, texts, **fields):
    """A GRPO trainer on the GSM8k fixture (no generator started) and one scored group per prompt holding the
    completions `texts[prompt]`, with behaviour log-probs equal to the model's own (on-policy)."""
    rows = load_prompt_dataset(GSM8K, data_files=FIXTURE)
    config = AsyncGRPOConfig(**{"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 2,
                                "max_completion_length": 16, "max_length": 160,
                                "generator_backend": "transformers", **fields})
    trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=gsm8k_reward, args=config, train_dataset=rows)
    tok, model = trainer.processing_class, trainer.model
    ids = [[tok(t, add_special_tokens=False)["input_ids"] for t in group] for group in texts]
    batch = RolloutBatch(0, 0, 0, list(range(len(texts))), trainer.prompt_token_ids[:len(texts)],
                         [[Completion(c, [0.0] * len(c), "stop") for c in group] for group in ids], 0.0)
    groups, _ = score_rows(batch, range(len(texts)), trainer.scorer, tok, lambda pid: rows[trainer.prompt_rows[pid]])
    packed = completion_batch(groups, tok.pad_token_id, config.max_length, "cpu")
    with torch.no_grad():
        own, mask, _ = token_logps(model, *packed[:3], temperature=config.temperature)
    for row, c in enumerate(c for g in groups for c in g.completions):
        c.logprobs[:] = own[row][mask[row] != 0].tolist()
    trainer._step_batch = batch  # the step's batch, as micro_batch_groups leaves it: "dapo" counts its tokens
    model.train()
    return trainer, groups


RIGHT_AND_WRONG = [[" #### 7", " #### 8"], [" #### 601", " #### 600"]]  # prompt 0 answers 7, prompt 1 600


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_exact_match_reward_steers_the_update_toward_the_right_answer(tmp_path, tiny_model_dir, loss_type):
    """No generator: two hand-written completions per prompt (the right '#### <answer>' and a wrong one), scored by
    the real scorer from the dataset's `final_answer` column, one GRPO step: the right one becomes likelier."""
    trainer, groups = _trainer_and_groups(tmp_path, tiny_model_dir, RIGHT_AND_WRONG, loss_type=loss_type)
    model, tok = trainer.model, trainer.processing_class
    assert [g.rewards for g in groups] == [[1.0, 0.0], [0.0, 1.0]]

    def sequence_logps():
        packed = completion_batch(groups, tok.pad_token_id, trainer.args.max_length, "cpu")
        with torch.no_grad():
            return token_logps(model, *packed[:3])[0].sum(-1)

    before = sequence_logps()
    loss, metrics = trainer.compute_rollout_loss(model, groups)
    assert metrics["reward"] == 0.5 and metrics["frac_reward_zero_std"] == 0.0
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    gain = (sequence_logps() - before).tolist()
    assert gain[0] > 0 and gain[1] < 0, gain  # prompt 0: right answer first
    assert gain[3] > 0 and gain[2] < 0, gain  # prompt 1: right answer second


def test_dapo_weighs_every_token_of_the_step_alike_across_micro_batches(tmp_path, tiny_model_dir):
    """TRL's "dapo" divides by the tokens of the whole accumulated batch: two micro-batches of one prompt each
    (gradient_accumulation_steps 2; the base class divides each loss by 2) give the loss of one micro-batch holding
    both prompts, though the prompts' completions differ in length. "bnpo" (per micro-batch) does not."""
    texts = [[" #### 7", " 3 + 4 = 7, so #### 8"], [" #### 601", " #### 600"]]
    for loss_type, equal in (("dapo", True), ("bnpo", False)):
        whole, groups = _trainer_and_groups(tmp_path / f"{loss_type}-1", tiny_model_dir, texts, loss_type=loss_type)
        one = whole.compute_rollout_loss(whole.model, groups)[0].item()
        split, groups = _trainer_and_groups(tmp_path / f"{loss_type}-2", tiny_model_dir, texts, loss_type=loss_type,
                                            per_device_train_batch_size=2, gradient_accumulation_steps=2)
        two = sum(split.compute_rollout_loss(split.model, [g])[0].item() for g in groups) / 2
        assert (abs(one - two) < 1e-6) == equal, (loss_type, one, two)


def test_recipe_hub_task_gsm8k_from_local_file(tmp_path, tiny_model_dir):
    """`recipes/grpo.py --task hub --dataset_name openai/gsm8k --hub_reward gsm8k` on the fixture file: the recipe's
    own path from flags to the loader, the exact-match reward and a saved policy, offline."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("grpo_recipe", os.path.join(root, "recipes", "grpo.py"))
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    trainer = recipe.main(["--task", "hub", "--model_name_or_path", tiny_model_dir, "--dataset_name", GSM8K,
                           "--dataset_data_files", FIXTURE, "--hub_reward", "gsm8k", "--output_dir", str(tmp_path),
                           "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2",
                           "--max_completion_length", "6", "--max_length", "160", "--generator_backend",
                           "transformers", "--disable_tqdm", "true", "--rollout_timeout", "120"])
    assert trainer.reward_funcs == [gsm8k_reward] and trainer.state.global_step == 2
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/gsm8k_reward/mean" in m for m in logged)
    assert (tmp_path / "model.safetensors").is_file()
