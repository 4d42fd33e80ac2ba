import math

import pytest

from async_rlhf.learner.logprobs import pack_sequences
from async_rlhf.scoring.rewards import RewardScorer, best_and_worst, score_rows
from async_rlhf.errors import RewardError
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


def test_best_and_worst_breaks_ties_like_max_and_min_of_reward_index_pairs():
    assert best_and_worst([0.1, 0.9, 0.5]) == (1, 0)
    assert best_and_worst([0.3, 0.3, 0.3]) == (2, 0)  # equal rewards: the last is best, the first worst
    assert best_and_worst([float("nan"), 1.0]) == (1, 1)
    assert best_and_worst([float("nan"), float("inf")]) is None  # no finite reward


class _CharTokenizer:
    """Decodes token id i as chr(96 + i); id 0 is EOS."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids if not (skip_special_tokens and i == 0))


def test_score_rows_scores_a_ranks_slice_and_passes_extra_columns():
    from async_rlhf.types import RolloutBatch

    seen = {}

    def reward(prompts, completions, completion_ids, weight, **kw):
        seen.update(prompts=prompts, weight=weight)
        return [len(c) * w for c, w in zip(completions, weight)]

    comps = [[Completion([1, 2, 0], [-1.0] * 3, "stop"), Completion([3], [-1.0], "length")] for _ in range(3)]
    batch = RolloutBatch(batch_id=4, generator_id=0, policy_version=3, prompt_ids=[7, 8, 9],
                         prompt_token_ids=[[1], [2], [3]], completions=comps, seconds=0.1)
    rows = {7: {"prompt": "p7", "weight": 1.0}, 8: {"prompt": "p8", "weight": 2.0}, 9: {"prompt": "p9", "weight": 3.0}}
    groups, metrics = score_rows(batch, range(1, 3), RewardScorer(reward), _CharTokenizer(), rows.__getitem__)
    assert [g.prompt_id for g in groups] == [8, 9] and all(g.policy_version == 3 for g in groups)
    assert seen == {"prompts": ["p8", "p8", "p9", "p9"], "weight": [2.0, 2.0, 3.0, 3.0]}
    # "ab" (EOS dropped in decoding) and "c": lengths 2 and 1, times the row's weight
    assert [g.rewards for g in groups] == [[4.0, 2.0], [6.0, 3.0]]
    assert metrics["rewards/reward/mean"] == pytest.approx((4 + 2 + 6 + 3) / 4)
    assert metrics["val/contain_eos_token"] == 0.5  # the first completion of each pair ends with EOS
    assert metrics["generator/completion_length"] == 2.0  # (3 + 1) / 2 tokens


def _half_none_reward(prompts, completions, completion_ids, **kw):
    return [None if len(c) == 1 else float(len(c)) + kw["bonus"][i] for i, c in enumerate(completions)]


def test_a_batch_scored_as_its_parts_arrive_trains_on_the_same_rewards_and_metrics():
    # inter-stage fusion: rank 0 scores each part (`score_part`), the batch crosses ranks as JSON, and the learner
    # uses those rewards instead of scoring again; everything must equal scoring the batch in the step
    from async_rlhf.data.tiny_model import char_tokenizer
    from async_rlhf.scoring.rewards import score_part, score_parts
    from async_rlhf.types import RolloutBatch

    tok = char_tokenizer()
    rows = {7: {"prompt": "ab", "bonus": 0.5}, 8: {"prompt": "xyz", "bonus": 2.0}}
    comps = [[Completion([40, 41], [-0.1, -0.2], "length"), Completion([42, tok.eos_token_id], [-0.3, -0.4], "stop")],
             [Completion([43], [-0.5], "length"), Completion([44, 45, 46], [-0.6, -0.7, -0.8], "length")]]
    batch = RolloutBatch(3, 0, 2, [7, 8], [[1, 2], [3]], comps, 0.1)
    scorer = RewardScorer([length_reward, _half_none_reward], reward_weights=[1.0, 2.0], missing_eos_penalty=1.0,
                          failure="skip")
    direct, direct_metrics = score_rows(batch, range(2), scorer, tok, rows.__getitem__)
    fused = RolloutBatch.from_dict(score_part(batch, scorer, tok, rows.__getitem__).to_dict())
    assert fused.rewards[0][1] is None  # a skipped sample crosses as None
    again, metrics = score_rows(fused, range(2), scorer, tok, rows.__getitem__)
    for a, b in zip(direct, again):
        assert [str(r) for r in a.rewards] == [str(r) for r in b.rewards]  # NaN included
    assert metrics == direct_metrics
    # parts that arrived together are scored in one call: the same rewards as each scored alone
    halves = [RolloutBatch(3, 0, 2, [pid], [ids], [group], 0.1, chunk=c, num_chunks=2)
              for c, (pid, ids, group) in enumerate(zip(batch.prompt_ids, batch.prompt_token_ids, comps))]
    together = score_parts(halves, scorer, tok, rows.__getitem__)
    alone = [score_part(h, scorer, tok, rows.__getitem__) for h in halves]
    assert [str(p.rewards) for p in together] == [str(p.rewards) for p in alone]
    assert [p.reward_components for p in together] == [p.reward_components for p in alone]
