"""A streaming generator (`serve_loops.serve_stream` on a real vLLM engine, in a real generator process) meets a
weight update while a sample is running, under both `weight_load` modes:

* "drain": the running sample finishes on the old weights (one version, its rollout before the update's
  acknowledgement), and the request queued behind the update is sampled wholly by the new weights;
* "in_flight": the update loads at once; the running sample continues on the new weights, its tokens carry the
  version that sampled them, and each token's behaviour log-prob is that of the version named for it, recomputed
  with the transformers forward over the whole context (old model before the switch, new model after).

Meanwhile a short request submitted with the long one comes back first (requests are answered as they finish, not
in batches). One generator process per mode: about 20 s each on 2 cores, most of it vLLM's start.
"""

from __future__ import annotations

import queue

import pytest
import torch
from pool_answers import Answers
from transformers import AutoModelForCausalLM

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.types import GenerationRequest, SamplingSettings
from async_rlhf.weight_sync import ShmWeightTransport

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

PROMPT = [2, 40, 41, 42]
LONG = SamplingSettings(max_new_tokens=200, temperature=1.0, n=1, seed=1)  # seed 1: no EOS within 200 under v0
ATOL = 1e-4  # float32 on both sides


def _request(batch_id: int, settings: SamplingSettings) -> GenerationRequest:
    return GenerationRequest(batch_id, [batch_id], [PROMPT], settings)


@torch.no_grad()
def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + tokens])
    logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


# drain (the default) is slow-tier here: the e2e run at max_staleness 0 loads its weights that way in the default tier
@pytest.mark.parametrize("weight_load", [pytest.param("drain", marks=pytest.mark.slow), "in_flight"])
def test_a_weight_update_meets_a_running_sample(tmp_path, tiny_model_dir, weight_load):
    pytest.importorskip("vllm")
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = tiny_llama(char_tokenizer(), seed=1).eval()
    spec = GeneratorSpec(generator_id=0, backend="vllm", model_path=tiny_model_dir, device="cpu", seed=0, threads=1,
                         engine_kwargs={"dtype": "float32", "kv_cache_memory_bytes": 64 << 20},
                         log_path=str(tmp_path / "generator-0.log"), streaming=True, weight_load=weight_load)
    got: queue.Queue = queue.Queue()
    transport = ShmWeightTransport(str(tmp_path))
    pool = GeneratorPool([spec], got.put, start_timeout=300, weight_sync_timeout=120, max_restarts=0)
    arrived = Answers(pool, got)  # batch -> its rollouts
    wait_for = arrived.wait_for

    try:
        pool.start()
        pool.send_request(0, _request(0, LONG))
        pool.send_request(0, _request(1, SamplingSettings(max_new_tokens=1, temperature=1.0, n=1, seed=2)))
        wait_for(lambda: 1 in arrived, "the short request's rollouts")  # so the long one has begun
        assert 0 not in arrived, "the short request waited for the long one"
        pool.send_weights(transport.publish(dict(new.state_dict()), 1))
        pool.send_request(0, _request(2, SamplingSettings(max_new_tokens=8, temperature=1.0, n=1, seed=3)))
        wait_for(lambda: pool.acks.loaded_version[0] == 1, "the acknowledgement of v1")
        long_done_at_ack = 0 in arrived
        wait_for(lambda: {0, 2} <= set(arrived), "the long and the queued requests' rollouts")
    finally:
        pool.close()
        transport.close()

    long = arrived[0].completions[0][0]
    after = arrived[2].completions[0][0]
    assert after.version_starts == [[1, 0]] and arrived[2].policy_version == 1  # queued behind the update
    assert arrived[1].completions[0][0].version_starts == [[0, 0]]
    if weight_load == "drain":
        assert long_done_at_ack, "the update loaded before the running sample finished"
        assert long.version_starts == [[0, 0]] and arrived[0].policy_version == 0
        assert long.finish_reason == "length" and len(long.token_ids) == 200
        assert torch.allclose(torch.tensor(long.logprobs), _logprobs(old, long.token_ids), atol=ATOL)
    else:
        assert not long_done_at_ack, "the update waited for the running sample"
        assert len(long.version_starts) == 2, long.version_starts
        (v0, start0), (v1, k) = long.version_starts
        assert (v0, start0, v1) == (0, 0, 1) and 0 < k < len(long.token_ids), long.version_starts
        assert arrived[0].policy_version == 0  # the oldest token's version: what the staleness bound sees
        got_lp = torch.tensor(long.logprobs)
        assert torch.allclose(got_lp[:k], _logprobs(old, long.token_ids)[:k], atol=ATOL)
        assert torch.allclose(got_lp[k:], _logprobs(new, long.token_ids)[k:], atol=ATOL)
