"""The group learners' reward-function contract (`RewardScorer.trl_arguments`, TRL 1.16's GRPOTrainer / RLOOTrainer):
the arguments a function receives in both data formats, None as NaN summed away, and what still fails; and the
leave-one-out baseline over scorable siblings (`losses/rloo.rloo_advantages`), with the arithmetic written out."""

from __future__ import annotations

import math

import pytest
import torch

from async_rlhf.errors import RewardError
from async_rlhf.losses.rloo import rloo_advantages
from async_rlhf.scoring.rewards import RewardScorer

CHAT = [{"role": "user", "content": "hi"}]


def _scorer(funcs, weights=None, failure="raise", state="STATE"):
    scorer = RewardScorer(funcs, weights, failure=failure)
    scorer.trl_arguments = True
    scorer.extra_kwargs = lambda: {"trainer_state": state, "log_metric": lambda *a: None, "log_extra": lambda *a: None}
    return scorer


def _score(scorer, raw_prompts, completions, columns=None):
    n = len(completions)
    return scorer.score(["templated"] * n, completions, [[1]] * n, [True] * n, list(range(n)), columns,
                        raw_prompts=raw_prompts)


def test_conversational_arguments_are_message_lists_with_columns_and_state():
    seen = {}

    def f(prompts, completions, completion_ids, trainer_state, some, **kwargs):
        seen.update(prompts=prompts, completions=completions, state=trainer_state, some=some, keys=set(kwargs))
        return [1.0] * len(completions)

    _score(_scorer(f), [CHAT, CHAT], ["a", "bc"], {"some": [1, 2], "completion": ["x", "y"]})
    assert seen["prompts"] == [CHAT, CHAT]  # as the dataset holds them, not chat-templated text
    assert seen["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "bc"}]]
    assert seen["state"] == "STATE" and seen["some"] == [1, 2]
    assert seen["keys"] == {"log_metric", "log_extra"}  # TRL passes neither `completion` nor `completion_ids` columns


def test_standard_arguments_are_text():
    seen = {}

    def f(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    _score(_scorer(f), ["Say", "Say"], ["a", "b"])
    assert seen == {"prompts": ["Say", "Say"], "completions": ["a", "b"]}


def test_none_is_nan_and_the_weighted_sum_skips_it():
    def f(completions, **kwargs):
        return [1.0, None, None]

    def g(completions, **kwargs):
        return [2.0, 3.0, None]

    total, per_func = _score(_scorer([f, g], weights=[0.5, 2.0]), ["p"] * 3, ["a", "b", "c"])
    # row 0: 0.5*1 + 2*2 = 4.5; row 1: f None -> 0 + 2*3 = 6; row 2: nothing scored it -> NaN (unscorable)
    assert total[:2].tolist() == [4.5, 6.0] and math.isnan(total[2])
    assert math.isnan(per_func["f"][1]) and per_func["g"][:2] == [2.0, 3.0]


def test_inf_and_exceptions_still_follow_reward_failure():
    def inf(completions, **kwargs):
        return [math.inf] * len(completions)

    def boom(completions, **kwargs):
        raise ValueError("no")

    with pytest.raises(RewardError, match="returned inf"):
        _score(_scorer(inf), ["p"], ["a"])
    with pytest.raises(RewardError, match="raised"):
        _score(_scorer(boom), ["p"], ["a"])
    total, _ = _score(_scorer([boom, inf], failure="skip"), ["p"], ["a"])
    assert math.isnan(total[0])  # skipped, as before: a raising call drops its samples

    def one(completions, **kwargs):
        return [1.0] * len(completions)

    total, _ = _score(_scorer([one, inf], failure="skip"), ["p"], ["a"])
    assert math.isnan(total[0])  # inf is a bad reward, not a missing one: the sample is dropped, not summed as 0


def test_rloo_baseline_averages_scorable_siblings_only():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, math.nan, 6.0], [5.0, math.nan, math.nan]])
    a = rloo_advantages(rewards)
    # row 0: 1 - (2+3)/2 = -1.5, 2 - 2 = 0, 3 - 1.5 = 1.5 (the usual leave-one-out)
    assert a[0].tolist() == [-1.5, 0.0, 1.5]
    # row 1: 4 - 6/1 = -2, NaN stays NaN, 6 - 4 = 2
    assert a[1, 0] == -2.0 and math.isnan(a[1, 1]) and a[1, 2] == 2.0
    # row 2: the only scorable completion has no sibling: 0/0 = NaN (the trainer zeroes it, as TRL)
    assert torch.isnan(a[2]).all()


def _episode(error="", env="GuessEnv", prompt=None):
    return {"messages": [{"role": "assistant", "content": "guess"}], "env": env, "state": {"solved": True},
            "rewards": {}, "error": error, "prompt": prompt or CHAT}


def test_episodes_pass_their_reset_prompt_and_unscorable_ones_reach_no_function():
    """Multi-turn: the prompt as `reset` extended it (TRL passes that one), the episode's messages, `environments=`;
    an episode whose environment failed is kept out of every function (one reading `completion[0]` would raise on
    it) and is NaN, counted as skipped."""
    seen = {}

    def f(prompts, completions, environments, **kwargs):
        seen.update(prompts=prompts, solved=[e.solved for e in environments])
        return [float(len(c[0]["content"])) for c in completions]

    scorer = _scorer(f)
    extended = [{"role": "user", "content": "hi (secret 3)"}]
    episodes = [_episode(prompt=extended), _episode(error="reset raised RuntimeError: x"), _episode()]
    episodes[1]["messages"] = []
    total, per_func = scorer.score(["t"] * 3, ["a", "", "c"], [[1], [], [2]], [True] * 3, [0, 0, 1], {"k": [1, 2, 3]},
                                   raw_prompts=[CHAT] * 3, episodes=episodes)
    assert seen == {"prompts": [extended, CHAT], "solved": [True, True]}
    assert total[0] == total[2] == 5.0 and math.isnan(total[1]) and math.isnan(per_func["f"][1])
    assert scorer.skipped == 1


def test_tools_without_environments_pass_no_environments():
    seen = {}

    def f(completions, **kwargs):
        seen.update(keys=set(kwargs))
        return [1.0] * len(completions)

    _scorer(f).score(["t"], ["a"], [[1]], [True], [0], {}, raw_prompts=[CHAT], episodes=[_episode(env="")])
    assert "environments" not in seen["keys"]
