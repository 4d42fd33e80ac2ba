"""Tail migration on two real streaming vLLM generators (`tail_migration`, `generation/tail.py`): a long request is
handed from one generator to the other in the middle of its samples, across a weight update, and comes back once,
from the other generator, with every token's behaviour log-prob equal to the transformers forward of the version
named for it (old weights before the update, new ones after), whichever engine sampled it. Two vLLM engines start
here (about 40 s on 2 cores): slow tier."""

from __future__ import annotations

import queue
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.generation.pool import GeneratorPool
from async_rlhf.generation.tail import TailMigration
from async_rlhf.generation.worker import GeneratorSpec
from async_rlhf.types import GenerationRequest, SamplingSettings
from async_rlhf.weight_sync import ShmWeightTransport

pytestmark = pytest.mark.slow

PROMPT = [2, 40, 41, 42]
ATOL = 1e-4  # float32 on both sides


@torch.no_grad()
def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + tokens])
    logits = model(ids).logits[0, len(PROMPT) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_a_tail_request_moves_to_the_other_generator_mid_sample(tmp_path, tiny_model_dir):
    pytest.importorskip("vllm")
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = tiny_llama(char_tokenizer(), seed=1).eval()
    specs = [GeneratorSpec(generator_id=g, backend="vllm", model_path=tiny_model_dir, device="cpu", seed=g, threads=1,
                           engine_kwargs={"dtype": "float32", "kv_cache_memory_bytes": 64 << 20},
                           log_path=str(tmp_path / f"generator-{g}.log"), streaming=True, weight_load="in_flight",
                           handoffs=True) for g in (0, 1)]
    got: queue.Queue = queue.Queue()
    transport = ShmWeightTransport(str(tmp_path))
    pool = GeneratorPool(specs, got.put, start_timeout=300, weight_sync_timeout=120, max_restarts=0)
    pool.tail = TailMigration(2)  # hand over once at most 2 requests of a batch are left, on 2 generators
    arrived: dict[int, object] = {}

    def wait_for(done, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            pool.check()
            try:
                r = got.get(timeout=0.01)
                assert r.chunk not in arrived, f"chunk {r.chunk} answered twice"
                arrived[r.chunk] = r
            except queue.Empty:
                assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s"

    long = SamplingSettings(max_new_tokens=240, temperature=1.0, n=2, seed=1)
    short = SamplingSettings(max_new_tokens=1, temperature=1.0, n=1, seed=5)

    def request(chunk: int, settings: SamplingSettings) -> GenerationRequest:
        return GenerationRequest(0, [chunk], [PROMPT], settings, chunk=chunk, num_chunks=3)

    try:
        pool.start()
        pool.send_request(0, request(0, long))
        pool.send_request(1, request(1, long))
        pool.send_weights(transport.publish(dict(new.state_dict()), 1))  # loads in flight, mid-sample
        # answered, it leaves chunks 0 and 1 of batch 0 in flight on generators 0 and 1: chunk 1 moves to 0
        pool.send_request(1, request(2, short))
        wait_for(lambda: len(arrived) == 3, "batch 0's three chunks")
    finally:
        pool.close()
        transport.close()

    assert pool.tail.handoffs == 1 and pool.tail.moved == 1, (pool.tail.handoffs, pool.tail.moved)
    assert pool.tail.moved_tokens > 0, "the request moved before any token was sampled"
    moved = arrived[1]
    assert moved.generator_id == 0, "the moved request was answered by the generator that held it"
    assert moved.policy_version == 0  # its oldest token: what the staleness bound sees
    for sample in moved.completions[0]:
        starts = sample.version_starts
        assert starts[0] == [0, 0] and [v for v, _ in starts] == sorted({v for v, _ in starts}), starts
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        bounds = [t for _, t in starts[1:]] + [len(sample.token_ids)]
        got_lp = torch.tensor(sample.logprobs)
        for (v, a), b in zip(starts, bounds):
            want = _logprobs(old if v == 0 else new, sample.token_ids)[a:b]
            assert torch.allclose(got_lp[a:b], want, atol=ATOL), (v, a, b)
    assert sum(len(s.token_ids) for s in moved.completions[0]) > pool.tail.moved_tokens  # it went on after the move
