"""Multi-turn runs through the whole pipeline (real generator processes, real sampling, the guessing task's
environment): a run stopped with episodes in flight and resumed trains loss for loss like an uninterrupted one; a
generator killed with episodes in flight is restarted and its episodes are played again from their start, every step
trained once; and RLOO takes the same `environment_factory` (here the dict form, rows routed by their `environment`
column).

The policy is conftest.py's `guess_policy`, SFT'd for seconds (it calls the tool in most turns); the whole guessing
task's build is not needed."""

from __future__ import annotations

import os
import signal
import time

import pytest
from datasets import Dataset
from run_records import check_staleness_records
from stop_at import check_resume_matches
from transformers import TrainerCallback

from async_rlhf.data import guess_task as g

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

FIELDS = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=160, learning_rate=1e-4,
              max_tool_calling_iterations=5, report_to="none", logging_steps=1, bf16=False, seed=3, beta=0.0,
              disable_tqdm=True, generator_start_timeout=120, rollout_timeout=300, generator_backend="transformers")


def test_a_run_stopped_with_episodes_in_flight_resumes_exactly(guess_policy, tmp_path):
    from async_rlhf import AsyncGRPOConfig, AsyncGRPOTrainer

    data = g.make_split(64, 0, "train")

    def make(out):  # max_staleness 1: when step 2 ends, batch 3's episodes are being played
        args = AsyncGRPOConfig(output_dir=str(out), max_steps=4, max_staleness=1, save_strategy="steps",
                               save_steps=2, **FIELDS)
        return AsyncGRPOTrainer(model=guess_policy, args=args, train_dataset=data, environment_factory=g.GuessEnv)

    check_resume_matches(make, tmp_path, steps=4, stop=2)


class _KillGenerator(TrainerCallback):
    """SIGKILLs generator 0 when optimizer step `step` ends (max_staleness 1: the next batch's episodes are being
    played then)."""

    def __init__(self, trainer, step):
        self.trainer, self.step = trainer, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(self.trainer.pipeline.pool.processes[0].pid, signal.SIGKILL)


def test_a_generator_killed_mid_episode_is_restarted_and_its_episodes_played_again(guess_policy, tmp_path):
    from async_rlhf import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=4, max_staleness=1, **FIELDS)
    trainer = AsyncGRPOTrainer(model=guess_policy, args=args, train_dataset=g.make_split(64, 0, "train"),
                               environment_factory=g.GuessEnv)
    trainer.add_callback(_KillGenerator(trainer, 2))
    trainer.train()
    s = trainer.run_summary
    assert s["generator_restarts"] == 1
    check_staleness_records(tmp_path, 4, 1, s, dropped=None)  # every step trained once, within the bound
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4  # whole episodes only: a request dies whole with its process and is sent again
    assert all(h["tools/call_frequency"] > 0 and h["episodes/unscorable"] == 0 for h in logs)


class SlowGuessEnv(g.GuessEnv):
    """The guessing environment with a tool latency (a remote service's), so that a learner step ends while the next
    batch's episodes are still being played."""

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: The number guessed, from 0 to 15.

        Returns:
            higher if the secret is higher than n, lower if it is lower, correct if it is n.
        """
        time.sleep(0.1)
        return super().guess(n)


@pytest.mark.slow  # the default tier checks the loads themselves: integration/test_episode_weight_loads.py
def test_weights_loaded_between_turns_keep_every_token_within_the_bound(guess_policy, tmp_path):
    """weight_load='in_flight': the learner's updates load between turns of the episodes being played; every sample's
    oldest and newest token versions stay within the bound (the records), and the run counts the episodes whose
    turns spanned versions (how many do depends on timing: tests/integration/test_episode_weight_loads.py makes one
    happen)."""
    from async_rlhf import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=2, max_staleness=1, weight_load="in_flight", **FIELDS)
    trainer = AsyncGRPOTrainer(model=guess_policy, args=args, train_dataset=g.make_split(64, 0, "train"),
                               environment_factory=SlowGuessEnv)
    trainer.train()
    check_staleness_records(tmp_path, 2, 1, trainer.run_summary)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(0 <= h["episodes/spanning_versions"] <= 1 for h in logs)


def test_rloo_routes_rows_to_their_environment(guess_policy, tmp_path):
    from async_rlhf import AsyncRLOOConfig, AsyncRLOOTrainer

    rows = list(g.make_split(32, 0, "train"))
    data = Dataset.from_list([{**r, "environment": "guess" if i % 2 else "control"} for i, r in enumerate(rows)])
    args = AsyncRLOOConfig(output_dir=str(tmp_path), max_steps=2, **FIELDS)
    trainer = AsyncRLOOTrainer(model=guess_policy, reward_funcs=None, args=args, train_dataset=data,
                               environment_factory={"guess": g.GuessEnv, "control": g.UninformativeGuessEnv})
    assert [f.__name__ for f in trainer.reward_funcs] == ["GuessEnv", "UninformativeGuessEnv"]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["tools/call_frequency"] > 0 for h in logs)
    # each episode is scored by its own environment's reward only: the two rewards split the samples between them
    assert all({"rewards/GuessEnv/mean", "rewards/UninformativeGuessEnv/mean"} <= set(h) for h in logs)


@pytest.mark.slow
def test_episodes_on_the_vllm_generator(guess_policy, tmp_path):
    """The vLLM backend plays the same episodes (token ids in, ids and log-probs out); on the on-policy first step the
    learner's log-probs equal vLLM's on every sampled token (tool answers out of the comparison). Slow: vLLM's CPU
    engine takes a while to start."""
    pytest.importorskip("vllm")
    from async_rlhf import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=2, **{**FIELDS, "generator_backend": "vllm"})
    trainer = AsyncGRPOTrainer(model=guess_policy, args=args, train_dataset=g.make_split(32, 0, "train"),
                               environment_factory=g.GuessEnv)
    assert not args.streaming  # 'auto' on vLLM would stream; episodes take batch-level serving
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["tools/call_frequency"] > 0 and h["episodes/turns"] > 1 for h in logs)
    assert logs[0]["queue/staleness_of_batch"] == 0 and logs[0]["off_policy/log_ratio_abs_max"] < 1e-2
