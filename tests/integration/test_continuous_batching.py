"""transformers' continuous batching as a generator (`continuous_batching`, experimental/continuous_batching/) held to
the other two backends' guarantees:

* the backend (in this process): behaviour log-probs equal log_softmax of the model's processed logits (temperature,
  top-k, top-p, min-p) for the sampled tokens, greedy tokens equal the transformers forward's argmax, completions cut
  at EOS or their prompt's budget, n samples per prompt; what it cannot honour is refused; one `generate` call on a
  fresh backend is reproducible, and `SamplingSettings.seed` does nothing (no per-request seeds);
* the streaming serve loop with its engine in a real generator process: a short request comes back before a long
  one; a weight update meets the long sample: with 'drain' it finishes on the old weights (one version), with
  'in_flight' its tokens after the load carry the new version and log-probs of the new model over the whole
  context; a request queued behind the update is sampled wholly by it (the FIFO rule);
* one short GRPO run through the recipe with TRL's `use_transformers_continuous_batching`.
"""

from __future__ import annotations

import json
import os
import queue
import sys

import pytest
import torch
from cb_engines import without_eos
from pool_answers import Answers
from run_records import check_staleness_records
from safetensors.torch import save_file
from session_run import ROOT, run_in_own_session
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.experimental.continuous_batching import ContinuousBatchingBackend
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.types import Completion, GenerationRequest, SamplingSettings, WeightUpdate
from async_rlhf.weight_sync import ShmWeightTransport

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

EOS = char_tokenizer().eos_token_id
PROMPTS = [[2, 40, 41, 42], [2, 50], [2, 60, 61, 62, 63, 64, 65]]
ATOL = 1e-4  # float32 on both sides; measured differences are below 1e-6
CACHE = {"kv_cache_memory_bytes": 8 << 20}  # 256 pages of 32 tokens for the tiny model: small, quick to allocate


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    b = ContinuousBatchingBackend(tiny_model_dir, seed=0, **CACHE)
    yield b
    b.close()
    b.close()  # idempotent


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def processed_logprobs(model, prompt: list[int], c: Completion, s: SamplingSettings, edit=None) -> torch.Tensor:
    """[T] log-prob of each token under log_softmax of the processed logits (temperature, top-k, top-p, min-p, in
    transformers' order), teacher-forced; `edit`: applied to the logits first (the test engine's EOS rule)."""
    logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].float()  # [T, V]
    if edit is not None:
        logits = edit(logits)
    if s.temperature > 0:
        logits = logits / s.temperature
        if s.top_k > 0:
            logits = TopKLogitsWarper(s.top_k)(None, logits)
        if s.top_p < 1:
            logits = TopPLogitsWarper(s.top_p)(None, logits)
        if s.min_p > 0:
            logits = MinPLogitsWarper(s.min_p)(None, logits)
    return logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == EOS:
            break
    return ids[len(prompt):]


SETTINGS = [SamplingSettings(max_new_tokens=16, temperature=0.0, n=1),
            SamplingSettings(max_new_tokens=12, temperature=0.7, top_k=5, n=4),
            SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=0.8, min_p=0.05, n=3)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["greedy", "temperature-top_k", "top_p-min_p"])
def test_behaviour_logprobs_are_the_processed_distributions(backend, reference, settings):
    result = backend.generate(PROMPTS, settings)
    for prompt, group in zip(PROMPTS, result, strict=True):
        assert len(group) == settings.n
        for c in group:
            expected = processed_logprobs(reference, prompt, c, settings)
            assert torch.isfinite(expected).all()  # every sampled token survived the filters
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=ATOL, rtol=0)
            if settings.temperature == 0:
                assert c.token_ids == greedy(reference, prompt, settings.max_new_tokens)


def test_n_samples_end_at_eos_or_their_budget(backend):
    # The random tiny model gives EOS ~1/104 per token: over 48 x 24 tokens both finish reasons occur.
    settings = SamplingSettings(max_new_tokens=24, temperature=1.0, n=16)
    result = backend.generate(PROMPTS, settings)
    reasons = set()
    for group in result:
        assert len(group) == 16 and len({tuple(c.token_ids) for c in group}) > 1
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) > 0
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1]
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 24 and EOS not in c.token_ids
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}
    budgets = [3, 9, 1]
    for group, budget in zip(backend.generate(PROMPTS, settings, budgets), budgets, strict=True):
        assert all(len(c.token_ids) <= budget for c in group)
        assert any(len(c.token_ids) == budget for c in group)


def test_one_call_on_a_fresh_backend_repeats_and_per_request_seeds_do_nothing(tiny_model_dir):
    settings = SamplingSettings(max_new_tokens=8, temperature=1.0, n=3, seed=3)

    def draw(seed: int, settings: SamplingSettings):
        b = ContinuousBatchingBackend(tiny_model_dir, seed=seed, **CACHE)
        try:
            return [[c.token_ids for c in g] for g in b.generate(PROMPTS, settings)]
        finally:
            b.close()

    first = draw(0, settings)
    assert draw(0, settings) == first  # the generator's seed, given to the manager when it starts
    assert draw(0, SamplingSettings(**{**settings.to_dict(), "seed": 4})) == first  # no per-request seed
    assert draw(1, settings) != first


def test_settings_it_cannot_honour_are_refused(backend, tiny_model_dir):
    with pytest.raises(ValueError, match="repetition_penalty=1.3"):
        backend.generate(PROMPTS, SamplingSettings(max_new_tokens=4, repetition_penalty=1.3))
    with pytest.raises(ValueError, match="allow_block_sharing"):
        ContinuousBatchingBackend(tiny_model_dir, continuous_batching={"allow_block_sharing": True})
    backend.use(SamplingSettings(max_new_tokens=4, temperature=1.0))
    backend.add("running", PROMPTS[0], 4)  # a sample of one setting runs ...
    with pytest.raises(ValueError, match="one sampling setting at a time"):
        backend.use(SamplingSettings(max_new_tokens=4, temperature=0.5))  # ... so another is refused
    backend.cancel("running")


# ---- the streaming serve loop, in a real generator process ---------------------------------------------------
LONG = SamplingSettings(max_new_tokens=200, temperature=1.0, n=1)  # 2 s or more in the test engine


def _request(batch_id: int, settings: SamplingSettings) -> GenerationRequest:
    return GenerationRequest(batch_id, [batch_id], [PROMPTS[0]], settings)


@pytest.mark.parametrize("weight_load", ["drain", "in_flight"])
def test_a_weight_update_meets_a_running_sample(tmp_path, tiny_model_dir, reference, weight_load):
    from cb_engines import SlowEngine

    new = tiny_llama(char_tokenizer(), seed=1).eval()
    spec = GeneratorSpec(generator_id=0, backend="transformers", model_path=tiny_model_dir, device="cpu", seed=0,
                         threads=1, engine_kwargs={"dtype": "float32", **CACHE},
                         log_path=str(tmp_path / "generator-0.log"), streaming=True, weight_load=weight_load,
                         stream_engine=SlowEngine)
    got: queue.Queue = queue.Queue()
    transport = ShmWeightTransport(str(tmp_path))
    pool = GeneratorPool([spec], got.put, start_timeout=120, weight_sync_timeout=60, max_restarts=0)
    arrived = Answers(pool, got)
    try:
        pool.start()
        pool.send_request(0, _request(0, LONG))
        pool.send_request(0, _request(1, SamplingSettings(max_new_tokens=1, temperature=1.0, n=1)))
        arrived.wait_for(lambda: 1 in arrived, "the short request's rollouts")  # so the long one has begun
        assert 0 not in arrived, "the short request waited for the long one"
        pool.send_weights(transport.publish(dict(new.state_dict()), 1))
        pool.send_request(0, _request(2, SamplingSettings(max_new_tokens=8, temperature=1.0, n=1)))
        arrived.wait_for(lambda: pool.acks.loaded_version[0] == 1, "the acknowledgement of v1")
        long_done_at_ack = 0 in arrived
        arrived.wait_for(lambda: {0, 2} <= set(arrived), "the long and the queued requests' rollouts")
    finally:
        pool.close()
        transport.close()

    long, after = arrived[0].completions[0][0], arrived[2].completions[0][0]
    assert after.version_starts == [[1, 0]] and arrived[2].policy_version == 1  # queued behind the update
    torch.testing.assert_close(torch.tensor(after.logprobs),
                               processed_logprobs(new, PROMPTS[0], after, LONG, without_eos), atol=ATOL, rtol=0)
    assert arrived[1].completions[0][0].version_starts == [[0, 0]]
    assert long.finish_reason == "length" and len(long.token_ids) == 200
    old_lp = processed_logprobs(reference, PROMPTS[0], long, LONG, without_eos)
    if weight_load == "drain":
        assert long_done_at_ack, "the update loaded before the running sample finished"
        assert long.version_starts == [[0, 0]] and arrived[0].policy_version == 0
        torch.testing.assert_close(torch.tensor(long.logprobs), old_lp, atol=ATOL, rtol=0)
    else:
        assert not long_done_at_ack, "the update waited for the running sample"
        assert len(long.version_starts) == 2, long.version_starts
        (v0, start0), (v1, k) = long.version_starts
        assert (v0, start0, v1) == (0, 0, 1) and 0 < k < len(long.token_ids), long.version_starts
        assert arrived[0].policy_version == 0  # the oldest token's version: what the staleness bound sees
        got_lp = torch.tensor(long.logprobs)
        new_lp = processed_logprobs(new, PROMPTS[0], long, LONG, without_eos)  # the new model over the whole context
        torch.testing.assert_close(got_lp[:k], old_lp[:k], atol=ATOL, rtol=0)
        torch.testing.assert_close(got_lp[k:], new_lp[k:], atol=ATOL, rtol=0)
        assert not torch.allclose(old_lp[k:], new_lp[k:], atol=ATOL)  # the two models differ there


def test_weights_are_refused_before_loading_when_names_differ(backend, tmp_path):
    state = tiny_llama(char_tokenizer(), seed=1).state_dict()
    state.pop("model.layers.0.mlp.up_proj.weight")
    save_file(state, str(tmp_path / "partial.safetensors"))
    with pytest.raises(RuntimeError, match="Missing key"):
        backend.load_weights(WeightUpdate(version=1, transport="shm", path=str(tmp_path / "partial.safetensors")))


# ---- a training run --------------------------------------------------------------------------------------------
STEPS = 4


def test_a_grpo_run_with_trls_continuous_batching_flag(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes/grpo.py"), "--task", "toy", "--output_dir", str(out),
           "--max_steps", str(STEPS), "--max_completion_length", "12", "--max_length", "64",
           "--max_staleness", "1", "--weight_load", "in_flight", "--disable_tqdm", "true", "--seed", "1",
           "--use_transformers_continuous_batching", "true",
           "--transformers_continuous_batching_config", json.dumps({"num_blocks": 64}),
           "--rollout_timeout", "120"]
    log = run_in_own_session(cmd, timeout=300)
    summary = json.loads((out / "run_summary.json").read_text())
    check_staleness_records(out, STEPS, 1, summary, dropped=None)
    generator_log = (out / "logs" / "generator-0.log").read_text()
    assert "=== async_rlhf run summary ===" in log
    assert "sampling with transformers' continuous batching" in generator_log  # the backend the engine built
    assert "Traceback" not in generator_log
