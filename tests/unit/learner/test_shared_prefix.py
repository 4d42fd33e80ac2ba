"""Shared-prefix reference log-probs (RLHFless): each group's prompt runs once through the frozen model and its key /
value cache serves the group's completions; the result must equal the unshared forward on the packed rows."""

import random

import pytest
import torch

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.learner.logprobs import completion_batch, sequence_terms, shared_prefix_logps, token_logps
from async_rlhf.types import Completion, ScoredGroup

TOK = char_tokenizer()
MODEL = tiny_llama(TOK, seed=0).eval()


def groups(n: int, count: int = 5, seed: int = 0) -> list[ScoredGroup]:
    rng = random.Random(seed)

    def completion():
        return Completion([rng.randrange(4, 90) for _ in range(rng.randint(1, 9))], [-1.0] * 9, "length")

    out = []
    for g in range(count):  # prompts of different lengths, so the left padding differs per group
        prompt = [rng.randrange(4, 90) for _ in range(rng.randint(2, 20))]
        comps = [completion() for _ in range(n)]
        comps = [Completion(c.token_ids, c.logprobs[:len(c.token_ids)], "length") for c in comps]
        out.append(ScoredGroup(g, prompt, comps, [0.0] * n, 0))
    return out


@pytest.mark.parametrize("n, temperature", [(2, 1.0), (4, 0.7), (8, 1.0)])
def test_shared_prefix_equals_the_unshared_forward(n, temperature):
    gs = groups(n)
    ids, attn, comp, _ = completion_batch(gs, TOK.pad_token_id, 64, "cpu")
    unshared, mask, _ = token_logps(MODEL, ids, attn, comp, temperature=temperature)
    shared = shared_prefix_logps(MODEL, gs, None, mask, 64, temperature=temperature)
    assert shared.shape == unshared.shape
    assert torch.equal(shared == 0, unshared == 0)  # the same positions hold completion log-probs
    assert torch.allclose(shared, unshared, atol=1e-5), (shared - unshared).abs().max()


def test_selected_rows_in_any_order_and_the_fallback_when_a_row_is_cut():
    gs = groups(4)
    select = [(3, 1), (0, 2), (3, 0), (1, 3)]  # DPO-style: chosen rows then rejected rows, groups repeated
    ids, attn, comp, _ = completion_batch(gs, TOK.pad_token_id, 64, "cpu", select)
    unshared, mask, _ = token_logps(MODEL, ids, attn, comp)
    assert torch.allclose(shared_prefix_logps(MODEL, gs, select, mask, 64), unshared, atol=1e-5)
    longest = max(len(g.prompt_token_ids) + len(c.token_ids) for g in gs for c in g.completions)
    assert shared_prefix_logps(MODEL, gs, None, mask, longest - 1) is None  # cut rows: prompts differ per row


def test_sequence_terms_with_a_shared_prefix_reference():
    gs = groups(2)
    kw = dict(pad_id=TOK.pad_token_id, max_length=64, device="cpu", temperature=1.0, sampling_temperature=1.0)
    plain = sequence_terms(MODEL, MODEL, gs, **kw)
    shared = sequence_terms(MODEL, MODEL, gs, shared_prefix=True, **kw)
    assert torch.allclose(plain.ref_logps, shared.ref_logps, atol=1e-5)
    assert torch.allclose(plain.logps, shared.logps, atol=1e-5)  # the policy: its own (bucketed) forward


def test_policy_shared_prefix_gives_the_unshared_log_probs_and_gradients():
    """Online DPO's policy runs each prompt once with gradient: log-probs, drift log-probs (another temperature) and
    every parameter's gradient equal the padded forward's."""
    from async_rlhf.learner.logprobs import shared_prefix_token_logps

    policy = tiny_llama(TOK, seed=3).train()
    gs = groups(2, count=6, seed=4)
    select = [(g, 0) for g in range(6)] + [(g, 1) for g in range(6)]
    ids, attn, comp, _ = completion_batch(gs, TOK.pad_token_id, 64, "cpu", select)
    padded, mask, padded_drift = token_logps(policy, ids, attn, comp, drift_temperature=0.7)
    padded.sum().backward()
    expected = {n: p.grad.clone() for n, p in policy.named_parameters()}
    policy.zero_grad()
    shared, drift = shared_prefix_token_logps(policy, gs, select, mask, 64, drift_temperature=0.7)
    shared.sum().backward()
    assert torch.allclose(shared, padded, atol=1e-5) and torch.allclose(drift, padded_drift, atol=1e-5)
    for name, p in policy.named_parameters():
        assert torch.allclose(p.grad, expected[name], atol=1e-5), name


def test_sequence_terms_with_a_shared_prefix_reference_and_policy():
    gs = groups(2)
    kw = dict(pad_id=TOK.pad_token_id, max_length=64, device="cpu", temperature=1.0, sampling_temperature=1.0)
    plain = sequence_terms(MODEL, MODEL, gs, split_forwards=False, **kw)
    shared = sequence_terms(MODEL, MODEL, gs, shared_prefix=True, policy_shared_prefix=True, **kw)
    for field in ("logps", "ref_logps", "drift_logps", "behaviour", "mask"):
        assert torch.allclose(getattr(plain, field), getattr(shared, field), atol=1e-5), field


def test_split_forwards_false_runs_every_row_padded(monkeypatch):
    import async_rlhf.learner.logprobs as logprobs

    def split(*args, **kwargs):
        raise AssertionError("split")

    monkeypatch.setattr(logprobs, "shared_prefix_token_logps", split)
    gs = groups(2)
    kw = dict(pad_id=TOK.pad_token_id, max_length=64, device="cpu", temperature=1.0, sampling_temperature=1.0,
              shared_prefix=True, policy_shared_prefix=True)
    sequence_terms(MODEL, MODEL, gs, split_forwards=False, **kw)  # a GPU learner's default: no split
    with pytest.raises(AssertionError, match="split"):
        sequence_terms(MODEL, MODEL, gs, split_forwards=True, **kw)
