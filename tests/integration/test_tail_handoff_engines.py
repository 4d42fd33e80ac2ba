"""Tail migration on two real streaming vLLM generators (`tail_migration`, `experimental/tail_migration/`): a long request is
handed from one generator to the other in the middle of its sample, a weight update loads while it goes on there,
and it comes back once, from the other generator, with every token's behaviour log-prob equal to the transformers
forward of the version named for it (old weights before the update, new ones after), whichever engine sampled it.
Two vLLM engines start here: about 20 s on 2 cores."""

from __future__ import annotations

import queue

import pytest
import torch
from pool_answers import Answers
from transformers import AutoModelForCausalLM

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.experimental.tail_migration import HandoffEngine, TailMigration
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.types import GenerationRequest, SamplingSettings
from async_rlhf.weight_sync import ShmWeightTransport

PROMPT = [2, 40, 41, 42]
ATOL = 1e-4  # float32 on both sides


@torch.no_grad()
def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + tokens])
    logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.slow  # an experimental schedule (experimental/tail_migration/)
def test_a_tail_request_moves_to_the_other_generator_mid_sample(tmp_path, tiny_model_dir):
    pytest.importorskip("vllm")
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = tiny_llama(char_tokenizer(), seed=1).eval()
    specs = [GeneratorSpec(generator_id=g, backend="vllm", model_path=tiny_model_dir, device="cpu", seed=g, threads=1,
                           engine_kwargs={"dtype": "float32", "kv_cache_memory_bytes": 64 << 20},
                           log_path=str(tmp_path / f"generator-{g}.log"), streaming=True, weight_load="in_flight",
                           stream_engine=HandoffEngine) for g in (0, 1)]
    got: queue.Queue = queue.Queue()
    transport = ShmWeightTransport(str(tmp_path))
    pool = GeneratorPool(specs, got.put, start_timeout=300, weight_sync_timeout=120, max_restarts=0)
    pool.scheduling = tail = TailMigration(2)  # hand over once at most 2 requests of a batch are left, on 2 generators
    arrived = Answers(pool, got, key=lambda r: (r.batch_id, r.chunk),  # (batch, chunk) -> its rollouts
                      context=lambda: f" (hand-overs sent {tail.handoffs}, answered {sorted(arrived)})")
    wait_for = arrived.wait_for

    long = SamplingSettings(max_new_tokens=200, temperature=1.0, n=1, seed=1)  # seed 1: no EOS within 200 under v0
    short = SamplingSettings(max_new_tokens=1, temperature=1.0, n=1, seed=5)

    def request(batch: int, chunk: int, settings: SamplingSettings) -> GenerationRequest:
        return GenerationRequest(batch, [chunk], [PROMPT], settings, chunk=chunk, num_chunks=3)

    def answered(batch: int) -> bool:
        return all((batch, c) in arrived for c in range(3))

    try:
        pool.start()
        # Chunk 2's answer leaves chunks 0 and 1 of the batch in flight on generators 0 and 1: chunk 1 moves to 0.
        # Unless, on a crowded machine, chunk 0 ended before chunk 2's answer was read: then the batch is tried again.
        for batch in range(3):
            pool.send_request(0, request(batch, 0, long))
            pool.send_request(1, request(batch, 1, long))
            pool.send_request(1, request(batch, 2, short))
            wait_for(lambda: tail.moved == 1 or answered(batch), "the hand-over of chunk 1")
            if tail.moved == 1:
                break
        pool.send_weights(transport.publish(dict(new.state_dict()), 1))  # the moved sample goes on under v1
        wait_for(lambda: answered(batch), f"batch {batch}'s three chunks")
    finally:
        pool.close()
        transport.close()

    assert tail.moved == 1 and tail.handoffs >= 1, (tail.handoffs, tail.moved)
    assert tail.moved_tokens > 0, "the request moved before any token was sampled"
    moved = arrived[batch, 1]
    assert moved.generator_id == 0, "the moved request was answered by the generator it was moved to"
    assert moved.policy_version == 0  # its oldest token: what the staleness bound sees
    sample = moved.completions[0][0]
    assert len(sample.logprobs) == len(sample.token_ids) > tail.moved_tokens  # it went on after the move
    starts = sample.version_starts  # v1 loads after the move, unless the sample ended before that
    assert [v for v, _ in starts] in ([0], [0, 1]) and starts[0] == [0, 0], starts
    assert len(starts) == 1 or starts[1][1] >= tail.moved_tokens, starts
    bounds = [t for _, t in starts[1:]] + [len(sample.token_ids)]
    got_lp = torch.tensor(sample.logprobs)
    for (v, a), b in zip(starts, bounds):  # v0: sampled on generator 1, then on 0; v1: on 0 after the update
        want = _logprobs(old if v == 0 else new, sample.token_ids)[a:b]
        assert torch.allclose(got_lp[a:b], want, atol=ATOL), (v, a, b)
