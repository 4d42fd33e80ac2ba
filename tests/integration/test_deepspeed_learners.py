"""DeepSpeed ZeRO-2 and ZeRO-3 learners on this CPU: `accelerate launch` with 2 gloo ranks and the configs under
launch/accelerate/, a real vLLM generator process, max_staleness 1, a few steps of a tiny model.

ZeRO-3 runs go through tests/integration/deepspeed_run.py, which also records how each model is held (policy and
reference partitioned, 1/2 of every parameter per rank) and checks the weight sync directly: the gathered
weights, loaded by a fresh vLLM generator, equal DeepSpeed's own consolidation of the learner's weights. The
ZeRO-2 run is the online DPO recipe itself, as the README launches it.

Wall times measured under pytest on the shared 2-core machine (load average 7-15 from other jobs; expect less on an
idle one), DeepSpeed's CPU ops already compiled (the first DeepSpeed run on a machine JIT-builds
`deepspeed_shm_comm`, about 3 minutes more; see docs/performance.md):
  ZeRO-3 online DPO + sync check: 311 s (slow) | ZeRO-3 RLOO + reward model + sync check: 260 s (slow)
  ZeRO-2 online DPO recipe: 176 s (slow)
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
from run_records import check_staleness_records
from session_run import run_in_own_session

STEPS = 3


def _launch(accelerate_config: str, script_args: list[str], out) -> dict:
    """Run `accelerate launch` in its own session; fail with the log's tail on error, timeout or leftovers."""
    cmd = ["accelerate", "launch", "--config_file", os.path.join("launch/accelerate", accelerate_config)] + script_args
    t0 = time.perf_counter()
    log = run_in_own_session(cmd, timeout=840, log_tail=8000)  # under pytest-timeout's 900 s
    wall = time.perf_counter() - t0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    facts_file = out / "deepspeed_facts.json"
    print(f"{accelerate_config} {' '.join(script_args[:3])}: {wall:.0f} s wall")
    return {"out": out, "summary": json.loads((out / "run_summary.json").read_text()),
            "steps": [m for m in metrics if "loss" in m], "log": log, "wall": wall,
            "facts": json.loads(facts_file.read_text()) if facts_file.exists() else None}


def _helper_run(tmp_path, accelerate_config: str, *flags: str) -> dict:
    out = tmp_path / "run"
    args = ["tests/integration/deepspeed_run.py", "--output_dir", str(out), "--steps", str(STEPS), *flags]
    return _launch(accelerate_config, args, out)


def _check_run(run: dict, zero_stage: int) -> None:
    """Finished, finite loss, staleness bound held, weights reached the generator, really under DeepSpeed."""
    summary, steps = run["summary"], run["steps"]
    assert summary["steps"] == STEPS and len(steps) == STEPS
    assert summary["learners"] == {"processes": 2, "distributed_type": "DEEPSPEED", "zero_stage": zero_stage}
    assert all(math.isfinite(m["loss"]) for m in steps), [m["loss"] for m in steps]
    check_staleness_records(run["out"], STEPS, 1, summary, dropped=0)
    assert summary["sync_bytes"] > 0 and steps[-1]["sync/count"] >= STEPS - 1
    assert min(summary["generator_versions"].values()) >= STEPS - 1, summary["generator_versions"]


def _check_zero3_sync_and_partitioning(facts: dict) -> None:
    assert facts["world_size"] == 2 and facts["zero_stage"] == 3
    for model in ("policy", "ref_model"):  # every rank stores half of each model, none holds a full copy
        held = facts[model]
        assert held["type"] == "DeepSpeedEngine" and held["partitioned"], (model, held)
        assert abs(held["local_fraction"] - 0.5) < 0.01, (model, held)
    assert facts["policy_optimizer"][1:] == ["DeepSpeedZeroOptimizer_Stage3", "AdamW"]  # torch AdamW under ZeRO
    assert facts["gathered_names_match"] and facts["gathered_max_abs_diff"] == 0.0
    # the generator computes with exactly the learner's (trained) weights, every parameter
    assert facts["generator_max_abs_diff"] <= 1e-6, facts
    assert facts["params_changed_by_training"] == facts["generator_params"] > 0
    # the network path's assembly from each rank's partitions (`weight_sync/partitions.py`) equals DeepSpeed's own
    # consolidation, and rank 0 never held the whole state for it
    assert facts["partitions_names_match"] and facts["partitions_max_abs_diff"] == 0.0
    assert facts["partitions_held_bytes_peak"] < facts["sync_bytes"], facts


@pytest.mark.slow  # ~5 min on 2 cores incl. DeepSpeed's first-use compile; launch configs are checked in the default suite
def test_zero3_online_dpo_trains_and_the_generator_gets_the_learners_weights(tmp_path):
    run = _helper_run(tmp_path, "cpu_deepspeed_zero3.yaml", "--algorithm", "online_dpo")
    _check_run(run, zero_stage=3)
    _check_zero3_sync_and_partitioning(run["facts"])


@pytest.mark.slow
def test_zero3_rloo_with_a_partitioned_reward_model_on_the_network_transport(tmp_path):
    """Also the network transport under ZeRO-3: each rank keeps its partitions, rank 0 assembles them bucket by
    bucket as it sends (`weight_sync/partitions.py`), and never holds a whole version for it."""
    run = _helper_run(tmp_path, "cpu_deepspeed_zero3.yaml", "--algorithm", "rloo", "--reward_model",
                      "--weight_transport", "network")
    _check_run(run, zero_stage=3)
    _check_zero3_sync_and_partitioning(run["facts"])
    last = run["steps"][-1]
    assert last["sync/partitioned"] == 1.0 and last["sync/held_bytes_peak"] > 0, last
    reward = run["facts"]["reward_model"]
    assert reward["type"] == "DeepSpeedEngine" and abs(reward["local_fraction"] - 0.5) < 0.01, reward


@pytest.mark.slow
def test_zero2_online_dpo_recipe(tmp_path):
    out = tmp_path / "run"
    args = ["recipes/online_dpo.py", "--task", "toy", "--output_dir", str(out), "--max_steps", str(STEPS),
            "--per_device_train_batch_size", "2", "--num_generations", "2", "--max_new_tokens", "8",
            "--max_length", "48", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
            "--disable_tqdm", "true", "--temperature", "1.0", "--max_staleness", "1", "--generator_backend", "vllm",
            "--rollout_timeout", "300", "--seed", "1", "--report_to", "none"]
    run = _launch("cpu_deepspeed_zero2.yaml", args, out)
    _check_run(run, zero_stage=2)
    assert (out / "model.safetensors").exists()  # the recipe saved the trained policy
