"""LoRA runs with a vLLM generator process on CPU, as a user launches them (`--use_peft`): the online DPO recipe in
one process, and under DeepSpeed ZeRO-2 (2 gloo ranks, `accelerate launch`) stopped at a checkpoint and resumed.
Each runs on-policy (max_staleness 0), so the generator's log-prob of every sampled token must equal the learner's:
vLLM computes with the merged LoRA policy after every sync (and, resumed, from the checkpoint's adapter).

Wall times under pytest on the shared 2-core machine (load average 3 to 8 from other jobs): vLLM recipe 73 s, ZeRO-2
run + resume 150 s (DeepSpeed's CPU ops already compiled). Slow: the default tier checks the same guarantees with the
transformers generator backend (test_lora_learners.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("peft")

from session_run import run_in_own_session  # noqa: E402

COMMON = ["--task", "toy", "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_new_tokens", "8",
          "--max_length", "48", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant", "--disable_tqdm",
          "true", "--max_staleness", "0", "--generator_backend", "vllm", "--rollout_timeout", "300", "--seed", "1",
          "--report_to", "none", "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules",
          "all-linear"]


def _records(out) -> dict[int, dict]:
    return {m["step"]: m for m in map(json.loads, open(out / "metrics.jsonl")) if "loss" in m}


def _check_on_policy(records: dict[int, dict], steps: list[int]) -> None:
    assert sorted(records) == steps
    drift = [records[s]["off_policy/chosen_log_ratio_abs_max"] for s in steps]
    assert max(drift) < 1e-4, drift  # vLLM's log-probs are the merged learner's
    assert records[steps[-1]]["sync/count"] >= 1


@pytest.mark.slow
def test_lora_online_dpo_recipe_with_a_vllm_generator(tmp_path):
    out = tmp_path / "run"
    run_in_own_session([sys.executable, "recipes/online_dpo.py", "--output_dir", str(out), "--max_steps", "4",
                        *COMMON], timeout=600, log_tail=6000)
    _check_on_policy(_records(out), [1, 2, 3, 4])
    summary = json.loads((out / "run_summary.json").read_text())
    assert 0 < summary["lora"]["trainable_parameters"] < summary["lora"]["base_parameters"]
    assert (out / "adapter_model.safetensors").exists() and (out / "merged" / "model.safetensors").exists()


@pytest.mark.slow
def test_lora_under_deepspeed_zero2_trains_and_resumes(tmp_path):
    out = tmp_path / "run"
    launch = ["accelerate", "launch", "--config_file", "launch/accelerate/cpu_deepspeed_zero2.yaml",
              "recipes/online_dpo.py", "--output_dir", str(out), *COMMON, "--save_strategy", "steps", "--save_steps",
              "2"]
    run_in_own_session(launch + ["--max_steps", "2"], timeout=840, log_tail=6000)
    assert "adapter_model.safetensors" in os.listdir(out / "checkpoint-2")
    run_in_own_session(launch + ["--max_steps", "4", "--resume_from_checkpoint", "last"], timeout=840, log_tail=6000)
    _check_on_policy(_records(out), [1, 2, 3, 4])  # step 3: the resumed generator started from checkpoint-2
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["learners"] == {"processes": 2, "distributed_type": "DEEPSPEED", "zero_stage": 2}
    assert summary["lora"]["optimizer_state_bytes"] < summary["lora"]["optimizer_state_bytes_full_finetune"]
