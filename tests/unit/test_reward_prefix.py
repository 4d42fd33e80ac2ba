"""Reward-model scores with each prompt's shared tokens run once (`reward_shared_prefix`, `scoring/reward_prefix.py`) equal
the padded forward's within float tolerance, with either padding side (the built-in task's tokenizer pads left)."""

import random
import string

import pytest
import torch
from transformers import LlamaForSequenceClassification

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.scoring.reward_prefix import shared_prefix_scores, supports_shared_prefix
from async_rlhf.scoring.rewards import RewardScorer


def reward_model(tok, seed=0):
    config = tiny_llama(tok).config
    config.num_labels = 1
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config).eval()


def texts(n: int, prompts: int = 6, seed: int = 0):
    rng = random.Random(seed)
    letters = string.ascii_letters + " .,"
    ps, cs = [], []
    for _ in range(prompts):  # prompts of different lengths: the prefix batch's left padding differs per prompt
        p = "".join(rng.choice(letters) for _ in range(rng.randint(3, 30)))
        for _ in range(n):
            ps.append(p)
            cs.append("".join(rng.choice(letters) for _ in range(rng.randint(0, 15))))
    return ps, cs


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_shared_prefix_rewards_equal_the_padded_forward(n, padding_side):
    tok = char_tokenizer()
    tok.padding_side = padding_side
    model = reward_model(tok)
    prompts, completions = texts(n, seed=n)
    completions[1] = completions[0]  # identical completions: the common prefix is the whole row, capped before the
    completions[2] = ""  # pooled token; an empty completion: the row is its prompt
    kw = dict(reward_processing_classes=[tok])
    plain = RewardScorer([model], **kw)._model_scores(model, tok, prompts, completions)
    shared = RewardScorer([model], shared_prefix=True, **kw)._model_scores(model, tok, prompts, completions)
    rows = tok([p + c for p, c in zip(prompts, completions)])["input_ids"]
    assert shared_prefix_scores(model, rows, prompts, "cpu") == shared  # the shared path ran, no fallback
    assert shared == pytest.approx(plain, abs=1e-5)
    assert len(set(plain)) > len(plain) // 2  # the scores differ from row to row: a real comparison


def test_rows_that_cannot_share_fall_back_and_other_rewards_are_untouched():
    tok = char_tokenizer()
    model = reward_model(tok)
    RewardScorer([model], reward_processing_classes=[tok])  # sets the model's pad token, as the trainer does
    assert supports_shared_prefix(model) and not supports_shared_prefix(tiny_llama(tok))  # a causal LM has no head
    pad = tok.pad_token_id
    assert shared_prefix_scores(model, [[5, 6], [pad, pad]], ["a", "a"], "cpu") is None  # all padding
    assert shared_prefix_scores(model, [[5, 6], [7, 6]], ["a", "a"], "cpu") is None  # nothing in common
    assert shared_prefix_scores(model, [[5, 6], [5, 7]], ["a", "a"], "cpu") is not None
