"""Length buckets: rows padded only to their bucket's longest row, and log-probs equal to the padded forward."""

import random

import torch

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.learner.logprobs import bucketed_token_logps, completion_batch, length_buckets, token_logps
from async_rlhf.types import Completion, ScoredGroup


def test_buckets_minimise_padded_tokens_plus_a_cost_per_forward():
    # four rows of 10 and four of 100: one bucket pads to 8 x 100 = 800 tokens (+ cost 50) = 850; two buckets
    # 4 x 10 + 4 x 100 = 440 (+ 2 x 50) = 540: two buckets, the short one first
    assert length_buckets([100, 10, 100, 10, 10, 100, 10, 100], forward_cost=50) == [[1, 3, 4, 6], [0, 2, 5, 7]]
    # the same rows with a forward worth 400 tokens: 440 + 800 > 800 + 400, so one bucket
    assert length_buckets([100, 10, 100, 10, 10, 100, 10, 100], forward_cost=400) == [[1, 3, 4, 6, 0, 2, 5, 7]]
    # lengths 1, 2, 3 with no forward cost: every length its own bucket (6 tokens), at most max_buckets of them
    assert length_buckets([3, 1, 2], forward_cost=0) == [[1], [2], [0]]
    assert length_buckets([3, 1, 2], forward_cost=0, max_buckets=2) in ([[1], [2, 0]], [[1, 2], [0]])
    assert length_buckets([7, 7, 7]) == [[0, 1, 2]] and length_buckets([]) == []


def test_bucketed_forward_equals_the_padded_one_with_gradients():
    tok = char_tokenizer()
    model = tiny_llama(tok, seed=0).train()
    rng = random.Random(0)
    groups = [ScoredGroup(g, [rng.randrange(4, 90) for _ in range(rng.choice((2, 3, 30)))],
                          [Completion([rng.randrange(4, 90) for _ in range(rng.choice((1, 2, 25)))], [], "length")
                           for _ in range(2)], [0.0, 1.0], 0) for g in range(8)]
    ids, attn, comp, _ = completion_batch(groups, tok.pad_token_id, 64, "cpu")
    buckets = length_buckets(attn.sum(-1).tolist(), forward_cost=8)
    assert len(buckets) > 1  # short and long rows: the split pays
    padded, mask, drift = token_logps(model, ids, attn, comp, drift_temperature=0.5)
    (padded * torch.arange(padded.shape[1])).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    bucketed, bmask, bdrift = bucketed_token_logps(model, ids, attn, comp, buckets, drift_temperature=0.5)
    (bucketed * torch.arange(bucketed.shape[1])).sum().backward()
    assert bucketed.shape == padded.shape and torch.equal(bmask, mask)
    assert torch.allclose(bucketed, padded, atol=1e-5) and torch.allclose(bdrift, drift, atol=1e-5)
    for got, want in zip((p.grad for p in model.parameters()), expected):
        assert torch.allclose(got, want, atol=1e-4)


def test_behaviour_logprobs_of_a_completion_cut_at_max_length_are_its_first_tokens():
    from async_rlhf.learner.logprobs import behaviour_logps, pack_sequences

    long = Completion([11, 12, 13, 14, 15, 16], [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0], "length")
    short = Completion([21, 22], [-0.5, -0.25], "stop")
    ids, _, mask, = pack_sequences([[1, 2], [3]], [long.token_ids, short.token_ids], pad_id=0, max_length=4)[:3]
    assert ids[0].tolist() == [2, 11, 12, 13]  # the prompt's last token and the completion's first 3 kept
    out = behaviour_logps([long, short], mask.float())
    assert out[0].tolist() == [0.0, -1.0, -2.0, -3.0]
    assert out[1].tolist() == [0.0, -0.5, -0.25, 0.0]
