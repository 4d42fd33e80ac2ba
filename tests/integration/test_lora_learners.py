"""LoRA learners (`peft_config`) trained end to end on the tiny Llama with a real generator process:
- only the adapters change; the reference is the base with adapters off (no second model);
- the generators hold the merged policy after every sync: on-policy (max_staleness 0), the generator's log-prob of
  every sampled token equals the learner's, and after training a generator backend loaded through the weight path
  gives the learner's logits on fixed prompts;
- the memory saved (trained parameters, gradients, optimizer state) is measured against full fine-tuning;
- a stopped run resumes from its adapter-only checkpoint exactly: the generators restart from the checkpoint's
  merged weights and the losses match an uninterrupted run's.
Transformers generator backend (seconds to start); the vLLM and DeepSpeed ZeRO-2 runs are in
test_lora_vllm_and_deepspeed.py (slow).
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer, AsyncRLOOConfig, AsyncRLOOTrainer  # noqa: E402
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts  # noqa: E402
from async_rlhf.weight_sync import ShmWeightTransport, gather_full_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

ALGORITHMS = {"online_dpo": (AsyncOnlineDPOTrainer, AsyncOnlineDPOConfig, "off_policy/chosen_log_ratio_abs_max"),
              "rloo": (AsyncRLOOTrainer, AsyncRLOOConfig, "off_policy/log_ratio_abs_max")}
PROMPTS = torch.tensor([[5, 17, 30, 44, 9, 12, 70, 3], [8, 8, 21, 60, 33, 2, 14, 40]])  # fixed token ids


def _lora():
    return peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=16, target_modules="all-linear")


def _records(output_dir) -> list[dict]:
    return [m for m in map(json.loads, open(os.path.join(output_dir, "metrics.jsonl"))) if "loss" in m]


def _base_name(peft_name: str) -> str:
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_lora_trains_only_adapters_and_generators_get_the_merged_policy(algorithm, tiny_model_dir, tiny_run_config,
                                                                       tmp_path):
    trainer_cls, config_cls, drift_metric = ALGORITHMS[algorithm]
    fields = {k: v for k, v in tiny_run_config(tmp_path).to_dict().items()
              if k in ("max_steps", "per_device_train_batch_size", "num_generations", "max_new_tokens",
                       "max_length", "learning_rate", "lr_scheduler_type", "generator_backend", "disable_tqdm",
                       "generator_start_timeout", "rollout_timeout")}
    if config_cls is AsyncRLOOConfig:  # RLOO counts completions (TRL): the same prompts per step
        fields["per_device_train_batch_size"] *= fields["num_generations"]
    config = config_cls(**{**fields, "output_dir": str(tmp_path / "out"), "max_steps": 4, "max_staleness": 0,
                           "temperature": 1.0, "seed": 3, "report_to": "none"})
    trainer = trainer_cls(model=tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                          train_dataset=toy_prompts(64), peft_config=_lora())
    assert trainer.ref_model is None  # the base with adapters off: no second copy (as TRL's trainers)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    # only the adapters changed; every base weight is the initial model's, bit for bit
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    trained = dict(trainer.model.named_parameters())
    adapters = {n for n, p in trained.items() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    for name, p in trained.items():
        if name not in adapters:
            assert torch.equal(p, initial[_base_name(name)]), name
    assert all(not torch.equal(trained[n], before[n]) for n in adapters if ".lora_B." in n)  # B starts at zero

    # on-policy, so every sampled token's generator log-prob must equal the learner's merged policy at that step
    records = _records(config.output_dir)
    assert len(records) == 4
    assert max(m[drift_metric] for m in records) < 1e-4, [m[drift_metric] for m in records]
    assert records[-1]["objective/kl"] != 0.0  # the adapters moved the policy away from the base (the reference)

    # after training: the weights a sync sends, loaded by the generators' transformers backend, give the learner's
    # logits on fixed prompts
    from async_rlhf.generation.engine.hf_backend import HFBackend

    transport = ShmWeightTransport(str(tmp_path))
    backend = HFBackend(tiny_model_dir)
    try:
        backend.load_weights(transport.publish(gather_full_state(trainer.model, True), version=5))
        with torch.no_grad():
            got, want = backend.model(input_ids=PROMPTS).logits, trainer.model(input_ids=PROMPTS).logits
    finally:
        backend.close()
        transport.close()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()

    # memory: AdamW keeps exp_avg and exp_avg_sq (fp32) and a step counter per trained tensor, for adapters only
    report = trainer.run_summary["lora"]
    n_adapter = sum(trained[n].numel() for n in adapters)
    assert report["trainable_parameters"] == n_adapter
    assert report["base_parameters"] == sum(t.numel() for t in initial.values())
    assert report["optimizer_state_bytes"] == 8 * n_adapter + 4 * len(adapters)
    assert report["optimizer_state_bytes_full_finetune"] > 5 * report["optimizer_state_bytes"]


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


@pytest.mark.slow  # 28 s; exact resume is default-tier in test_resume.py, LoRA training in the tests above
def test_lora_run_resumes_from_its_adapter_checkpoint_exactly(tiny_model_dir, tiny_run_config, tmp_path):
    config = functools.partial(tiny_run_config, max_steps=4, per_device_train_batch_size=4, max_new_tokens=8,
                               max_staleness=0, seed=7, save_strategy="steps", save_steps=2, report_to="none")
    data = toy_prompts(48)

    def run(out, stop=None, resume=None):
        trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config(out),
                                        train_dataset=data, peft_config=_lora())
        if stop:
            trainer.add_callback(StopAt(stop))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    run(tmp_path / "full")
    run(tmp_path / "cut", stop=2)
    checkpoint = tmp_path / "cut" / "checkpoint-2"
    saved = set(os.listdir(checkpoint))
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved  # adapters only
    run(tmp_path / "cut", resume=True)
    want = {m["step"]: m for m in _records(tmp_path / "full")}
    got = {m["step"]: m for m in _records(tmp_path / "cut")}
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    for step in want:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], abs=1e-5), (step, want, got)
    # the resumed generators sampled with the checkpoint's merged weights (not the base's)
    assert got[3]["off_policy/chosen_log_ratio_abs_max"] < 1e-4
