"""TRL 1.16's multi-turn GRPO form, `environment_factory=` and `tools=`, run against TRL's `GRPOTrainer` (the control)
and ours under TRL's names: a TRL script with tools switched by one import. Offline: the guessing task's tokenizer
(TRL's checks pass, its parser reads the calls) and a policy SFT'd for seconds on the task's demonstrations, which
calls the tool in most turns. What upstream's tool tests check is checked on both: the reward named after the
environment class, the tool names, TRL's `tools/*` metrics, reward functions receiving `environments=`, a standalone
tool offered beside the environment's (tool failures and timeouts: tests/unit/generation/engine/test_episodes.py).
Ours also: the on-policy first step's learner log-probs equal the generator's (tool answers out of the comparison),
and the episodes' metrics. The policy is conftest.py's `guess_policy`. Marked `integration`."""

from __future__ import annotations

import pytest

from async_rlhf.data import guess_task as g

pytestmark = pytest.mark.integration

FIELDS = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=160, max_steps=2,
              max_tool_calling_iterations=5, learning_rate=1e-4, report_to="none", logging_steps=1, bf16=False,
              seed=0, beta=0.0)
OURS = dict(disable_tqdm=True, generator_start_timeout=120, rollout_timeout=300, generator_backend="transformers")

def solved(completions, environments, **kwargs):
    """A reward function reading the environments, as TRL passes them."""
    return [1.0 if e.solved else 0.0 for e in environments]


def hint(topic: str) -> str:
    """A standalone tool that always fails.

    Args:
        topic: what the hint is about
    """
    raise RuntimeError("no hints in this game")


def _classes(impl):
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from async_rlhf import AsyncGRPOConfig as GRPOConfig
        from async_rlhf import AsyncGRPOTrainer as GRPOTrainer
    return GRPOConfig, GRPOTrainer


@pytest.mark.parametrize("impl", ["trl", "ours"])
def test_environment_factory_and_tools_train_under_either_import(impl, guess_policy, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoTokenizer

    GRPOConfig, GRPOTrainer = _classes(impl)
    args = GRPOConfig(output_dir=str(tmp_path), **FIELDS, **(OURS if impl == "ours" else {"use_cpu": True}))
    trainer = GRPOTrainer(model=guess_policy, reward_funcs=[solved], args=args,
                          train_dataset=g.make_split(32, 0, "train"),
                          processing_class=AutoTokenizer.from_pretrained(guess_policy), environment_factory=g.GuessEnv,
                          tools=[hint])
    if impl == "trl":
        assert trainer.reward_func_names == ["solved", "GuessEnv"]
        assert sorted(t.__name__ for t in trainer.tools) == ["guess", "hint"]
    else:
        assert [f.__name__ for f in trainer.reward_funcs] == ["solved", "GuessEnv"]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert {"tools/call_frequency", "tools/failure_frequency", "rewards/solved/mean", "rewards/GuessEnv/mean",
                "reward"} <= set(h)
        assert h["rewards/solved/mean"] == h["rewards/GuessEnv/mean"]  # the same fact, read two ways
    assert sum(h["tools/call_frequency"] for h in logs) > 0  # the SFT policy calls the tool
    if impl == "ours":
        assert all(h["episodes/turns"] >= 1 and h["episodes/unscorable"] == 0 for h in logs)
        assert logs[0]["queue/staleness_of_batch"] == 0
        assert logs[0]["off_policy/log_ratio_abs_max"] < 1e-3  # on-policy: learner and generator agree per token
