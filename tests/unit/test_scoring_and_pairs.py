import math

import pytest
import torch

from async_rlhf.logprobs import pack_sequences
from async_rlhf.scoring import RewardError, RewardScorer
from async_rlhf.trainers.online_dpo import select_pairs
from async_rlhf.types import Completion, ScoredGroup


def group(rewards):
    c = Completion([1], [-0.5], "stop")
    return ScoredGroup(0, [9], [c] * len(rewards), rewards, 0)


def test_select_pairs_best_vs_worst_skipping_ties_and_invalid():
    groups = [group([0.1, 0.9, 0.5]), group([0.3, 0.3]), group([float("nan"), 1.0]), group([2.0, 1.0])]
    pairs, skipped = select_pairs(groups)
    assert pairs == [(0, 1, 0), (3, 0, 1)]
    assert skipped == 2  # the tie and the group with one valid score


def length_reward(prompts, completions, completion_ids, **kw):
    return [float(len(c)) for c in completions]


def test_weighted_sum_and_missing_eos_penalty():
    s = RewardScorer([length_reward, length_reward], reward_weights=[1.0, 0.5], missing_eos_penalty=2.0)
    scores, per_func = s.score(["p", "p"], ["ab", "abcd"], [[1, 2], [1, 2, 3, 4]], [True, False], [0, 1])
    # 1*2 + 0.5*2 = 3 ; 1*4 + 0.5*4 - 2 (no EOS) = 4
    assert scores.tolist() == [3.0, 4.0]
    assert per_func["length_reward"] == [2.0, 4.0]


def none_reward(prompts, completions, completion_ids, **kw):
    return [None, 1.0]


def raising_reward(prompts, completions, completion_ids, **kw):
    raise KeyError("label")


def test_reward_failures_raise_naming_function_and_prompt():
    with pytest.raises(RewardError, match=r"'none_reward' returned None for prompt id 7"):
        RewardScorer(none_reward).score(["p", "p"], ["a", "b"], [[1], [2]], [True, True], [7, 8])
    with pytest.raises(RewardError, match=r"'raising_reward' raised on prompt ids \[7, 8\]: KeyError"):
        RewardScorer(raising_reward).score(["p", "p"], ["a", "b"], [[1], [2]], [True, True], [7, 8])


def test_reward_failures_can_be_skipped_and_counted():
    s = RewardScorer(none_reward, failure="skip")
    scores, _ = s.score(["p", "p"], ["a", "b"], [[1], [2]], [True, True], [7, 8])
    assert math.isnan(scores[0]) and scores[1] == 1.0 and s.skipped == 1


def test_reward_weights_must_match():
    with pytest.raises(ValueError, match="reward_weights: 1 weight"):
        RewardScorer([length_reward, length_reward], reward_weights=[1.0])


def test_pack_sequences_right_pads_and_cuts_prompts_from_the_left():
    ids, attn, comp = pack_sequences([[1, 2, 3], [4]], [[7, 8], [9]], pad_id=0, max_length=4)
    assert ids.tolist() == [[2, 3, 7, 8], [4, 9, 0, 0]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert comp.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
