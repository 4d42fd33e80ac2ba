"""Speculative rollouts keep the policy's distribution and its behaviour log-probs (issue 34), on a real vLLM engine.

One engine for the whole module (`speculative="ngram"`, 4 draft tokens) on a tiny Llama whose output layer is
scaled up so that its next-token distributions are peaked and its samples repeat themselves: ngram drafts then get
accepted (about 15% of drafted tokens here), so accepted, bonus and rejected-then-resampled positions all occur.

The distribution test. For each sampled token t with the policy's (processed: temperature, top-k, top-p)
distribution p at that position, computed by the transformers forward over the whole context, the randomised
probability integral transform u = P(X < t) + V p(t), V ~ U(0, 1), is exactly U(0, 1) and independent along the
sequence if and only if every token is drawn from p given its prefix: the samples without speculation (vLLM's plain
sampler) satisfy this by construction, so "with speculation equals without" is "u is uniform". Tokens are ranked by
decreasing probability for u, so u says how far down the policy's ranking each token was. Two statistics on a few
thousand tokens decide: a Kolmogorov-Smirnov test of the u's, and the z-score of the summed log-probs of the tokens
against their expectation under p (a martingale: N(0, 1) when every token follows p), and likewise the z-score of
the number of tokens equal to a prompt-lookup guess made from their prefix (too many: drafts accepted too often; too
few: too seldom). The same statistics reject a
deliberately wrong acceptance rule (every draft token accepted), put into vLLM's rejection sampler for that one test
only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from async_rlhf.config.speculative import vllm_config
from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.types import GenerationRequest, SamplingSettings

SCALE = 25.0  # output-layer scale: peaked distributions, repetitive samples, drafts that get accepted
PROMPTS = [[2] + list(range(10 + p, 16 + p)) for p in range(16)]
ATOL = 1e-4  # float32 on both sides
P_MIN = 1e-4  # KS p-value a correct sampler must exceed (the test's false-alarm rate)
Z_MAX = 4.0  # and |z| of its summed log-probs below this (false alarms: 6e-5)


def _peaked_model(seed: int = 0):
    model = tiny_llama(char_tokenizer(), seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(SCALE)
    return model.eval()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("peaked"))
    model = _peaked_model()
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def engine(policy):
    from async_rlhf.generation.engine.vllm_backend import VLLMBackend

    backend = VLLMBackend(policy[0], dtype="float32", kv_cache_memory_bytes=64 << 20,
                          speculative_config=vllm_config("ngram", 4))
    yield backend
    backend.close()


@torch.no_grad()
def _processed_logprobs(model, prompt: list[int], tokens: list[int], s: SamplingSettings) -> torch.Tensor:
    """[len(tokens), vocab] log-probs of the distribution vLLM samples from (temperature, then top-k, then top-p)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float() / s.temperature
    if s.top_k > 0:
        kth = logits.topk(s.top_k, -1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if s.top_p < 1:
        ordered, order = logits.sort(-1)  # ascending, as vLLM: drop the low tail whose mass is <= 1 - top_p
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - s.top_p
        drop[:, -1] = False
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, -float("inf")))
    return logits.log_softmax(-1)


def _ks_uniform(values) -> float:
    """Kolmogorov-Smirnov p-value of `values` against U(0, 1) (the asymptotic Kolmogorov distribution; thousands of
    values here)."""
    u = np.sort(np.asarray(values))
    n = len(u)
    d = max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max())
    k = np.arange(1, 101)
    return float(min(1.0, max(0.0, 2 * np.sum((-1.0) ** (k - 1) * np.exp(-2 * k ** 2 * n * d ** 2)))))


def _lookup(context: list[int]) -> int | None:
    """The token that followed the latest earlier occurrence of the context's last two tokens (what a prompt-lookup
    drafter would propose first), or None."""
    key = context[-2:]
    for i in range(len(context) - 3, 0, -1):
        if context[i - 1:i + 1] == key:
            return context[i + 1]
    return None


def _statistics(model, prompts, groups, s: SamplingSettings, check_logprobs: bool = True) -> tuple[float, ...]:
    """Of the sampled tokens under the policy: (KS p-value of the PIT values, z of the summed log-probs, z of the
    number of tokens equal to the prompt-lookup guess `_lookup`); with `check_logprobs`, also assert every returned
    log-prob equals the forward's."""
    rng = np.random.default_rng(0)
    pits, surprise, mean, var = [], 0.0, 0.0, 0.0
    hits, hit_mean, hit_var = 0, 0.0, 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            lp = _processed_logprobs(model, prompt, c.token_ids, s).double()
            picked = lp.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            if check_logprobs:
                assert torch.allclose(torch.tensor(c.logprobs, dtype=torch.float64), picked, atol=ATOL), \
                    (c.logprobs, picked.tolist())
            probs = lp.exp()
            # PIT with the tokens in order of decreasing probability: u says how far down the ranking t was
            above = (probs * (probs > picked.exp()[:, None])).sum(-1)
            pits += (above + torch.from_numpy(rng.random(len(picked))) * picked.exp()).tolist()
            finite = torch.where(probs > 0, lp, torch.zeros_like(lp))
            e = (probs * finite).sum(-1)  # E[log p(X)] under the policy, per position
            surprise += picked.sum().item()
            mean += e.sum().item()
            var += ((probs * finite ** 2).sum(-1) - e ** 2).sum().item()
            for i, t in enumerate(c.token_ids):  # a predictable guess: the indicator t == guess has mean p(guess)
                guess = _lookup(prompt + c.token_ids[:i])
                if guess is not None:
                    q = probs[i, guess].item()
                    hits, hit_mean, hit_var = hits + (t == guess), hit_mean + q, hit_var + q * (1 - q)
    return _ks_uniform(pits), (surprise - mean) / var ** 0.5, (hits - hit_mean) / hit_var ** 0.5


def _check(engine, model, s: SamplingSettings, prompts=PROMPTS) -> tuple[float, float, dict]:
    before = engine.spec_counters()
    groups = engine.generate(prompts, s)
    after = engine.spec_counters()
    return *_statistics(model, prompts, groups, s), {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("settings", [
    SamplingSettings(max_new_tokens=32, temperature=1.0, n=8, seed=0),
    SamplingSettings(max_new_tokens=32, temperature=0.8, top_k=20, top_p=0.9, n=8, seed=1),
], ids=["temperature1", "top_k_top_p"])
def test_speculative_samples_follow_the_policy(engine, policy, settings):
    prompts = PROMPTS if settings.top_k == 0 else PROMPTS[:8]
    pvalue, z, z_guess, counters = _check(engine, policy[1], settings, prompts)
    assert counters["accepted_tokens"] > 20, counters  # acceptance really happened (and so did rejection)
    assert counters["draft_tokens"] > counters["accepted_tokens"], counters
    assert pvalue > P_MIN and abs(z) < Z_MAX and abs(z_guess) < Z_MAX, \
        f"tokens do not follow the policy: KS p={pvalue:.2e}, z={z:.1f}, z_guess={z_guess:.1f} ({counters})"


def test_the_statistic_rejects_a_wrong_acceptance_rule(engine, policy, monkeypatch):
    """Accept every draft token whatever the policy says: the same statistic must see it."""
    from vllm.v1.sample import rejection_sampler

    right = rejection_sampler.rejection_sample

    def accept_all(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs, target_logits,
                   bonus_token_ids, sampling_metadata, **kwargs):
        out = right(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                    target_logits, bonus_token_ids, sampling_metadata, **kwargs)
        start = 0
        for r, n in enumerate(num_draft_tokens):
            out[r, :n] = draft_token_ids[start:start + n]
            out[r, n] = bonus_token_ids[r, 0]
            out[r, n + 1:] = rejection_sampler.PLACEHOLDER_TOKEN_ID
            start += n
        return out

    monkeypatch.setattr(rejection_sampler, "rejection_sample", accept_all)
    s = SamplingSettings(max_new_tokens=32, temperature=1.0, n=8, seed=2)
    groups = engine.generate(PROMPTS, s)
    monkeypatch.setattr(rejection_sampler, "rejection_sample", right)
    pvalue, z, z_guess = _statistics(policy[1], PROMPTS, groups, s, check_logprobs=False)
    assert z_guess > 2 * Z_MAX, \
        f"a wrong acceptance rule went unseen: KS p={pvalue:.2e}, z={z:.1f}, z_guess={z_guess:.1f}"


def test_a_weight_load_between_speculative_requests(engine, policy, tmp_path):
    """`weight_load="drain"` on a speculating engine: weights load while it is empty; the next sample is wholly the new
    version's, log-probs included (last test here: it leaves the engine on the new weights). ("in_flight" with
    speculation is refused by the config: on vLLM 0.32 CPU a sample running when weights land continues with
    log-probs of neither version, see docs/performance.md, speculative rollouts.)"""
    from async_rlhf.generation.engine.stream_engine import StreamEngine
    from async_rlhf.weight_sync import ShmWeightTransport

    new = _peaked_model(seed=1)
    stream = StreamEngine(engine, generator_id=0)
    engine.llm.update_weight_version("0")
    s = SamplingSettings(max_new_tokens=64, temperature=1.0, n=2, seed=5)
    transport = ShmWeightTransport(str(tmp_path))
    try:
        engine.load_weights(transport.publish(dict(new.state_dict()), 1))
    finally:
        transport.close()
    before = engine.spec_counters()
    stream.submit(GenerationRequest(0, [0], [PROMPTS[0]], s), version=1)
    done = []
    while not done:
        done = stream.step(1)
    assert engine.spec_counters()["accepted_tokens"] > before["accepted_tokens"]
    assert done[0].policy_version == 1
    for c in done[0].completions[0]:
        assert c.version_starts == [[1, 0]]
        expected = _processed_logprobs(new, PROMPTS[0], c.token_ids, s).gather(-1, torch.tensor(c.token_ids)[:, None])
        assert torch.allclose(torch.tensor(c.logprobs), expected[:, 0], atol=ATOL)
