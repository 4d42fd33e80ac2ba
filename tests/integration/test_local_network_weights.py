"""Local vLLM generator processes on the "network" weight transport (`weight_transport='network'`): each joins a
gloo group of its own with learner rank 0 through its inbox (`generation/pool/network_feeds.py`) and loads every version
through vLLM's weight-transfer calls with our `async_rlhf_gloo` backend.

Checks: two generators train to the end at max_staleness 0 with every version loaded by both, the per-sample
staleness records hold and the behaviour log-probs equal the learner's; a generator SIGKILLed mid-broadcast is
restarted, joins a new group and loads the next version, and the run completes; a stopped-and-resumed run matches
an uninterrupted one loss for loss (slow).
"""

from __future__ import annotations

import functools
import json
import os
import signal

import pytest
from mid_broadcast import train_killing_mid_broadcast
from run_records import check_staleness_records
from stop_at import check_resume_matches

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

pytest.importorskip("vllm")


@pytest.fixture
def config(tiny_run_config):
    return functools.partial(tiny_run_config, generator_backend="vllm", weight_transport="network", max_staleness=0,
                             per_device_train_batch_size=4, max_new_tokens=8, generator_threads=1,
                             weight_sync_timeout=120, generator_start_timeout=600, rollout_timeout=300, seed=7)


def _logged(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.slow  # 1-3 min; the network path stays in the default tier through test_network_weights.py
def test_two_generators_train_over_the_network_logprobs_equal(tmp_path, tiny_model_dir, config):
    steps = 3
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=toy_prompts(48),
                                    args=config(tmp_path, max_steps=steps, generator_devices=["cpu", "cpu"]))
    trainer.train()
    s = trainer.run_summary
    assert s["steps"] == steps and s["generators"] == 2
    assert check_staleness_records(tmp_path, steps, 0, s, dropped=0) == [0] * steps
    assert min(s["generator_versions"].values()) >= steps - 1  # both loaded every version a batch could need
    metrics = _logged(tmp_path)
    assert any("sync/network_send_seconds" in m for m in metrics), "no version went over the network"
    for m in (m for m in metrics if "loss" in m):  # on-policy: the generators' log-probs are the learner's
        for key in ("off_policy/chosen_log_ratio_abs_max", "off_policy/rejected_log_ratio_abs_max"):
            assert m[key] < 1e-3, (m["step"], key, m[key])


@pytest.mark.slow
def test_generator_killed_mid_broadcast_is_restarted_and_joins_the_next_version(tmp_path, tiny_model_dir, config,
                                                                               monkeypatch):
    """SIGKILL the generator once rank 0 starts sending a version's bytes (after both voted): the send fails, the
    pool restarts the generator with a new group, the newest version reaches it first, and the run completes."""
    steps = 5
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=toy_prompts(48),
                                    args=config(tmp_path, max_steps=steps, max_staleness=1))
    killed = train_killing_mid_broadcast(
        trainer, lambda t: os.kill(t.pipeline.pool.processes[0].pid, signal.SIGKILL), monkeypatch)
    s = trainer.run_summary
    assert killed, "the generator was never killed mid-broadcast"
    assert s["steps"] == steps
    assert s["generator_restarts"] == 1
    assert min(s["generator_versions"].values()) >= steps - 1  # the restarted generator caught up
    check_staleness_records(tmp_path, steps, 1, s, dropped=0)


@pytest.mark.slow
def test_stopped_and_resumed_network_run_matches_an_uninterrupted_one(tmp_path, tiny_model_dir, config):
    data = toy_prompts(48)
    check_resume_matches(lambda out: AsyncOnlineDPOTrainer(
        tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=data,
        args=config(out, max_steps=6, save_strategy="steps", save_steps=3)), tmp_path, steps=6, stop=3)
