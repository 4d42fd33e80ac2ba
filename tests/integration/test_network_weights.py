"""The "network" weight transport through vLLM's weight-transfer interface: our `async_rlhf_gloo` backend (the CPU
twin of vLLM's nccl engine) in a real vLLM engine (CPU, in this process), driven by learner rank 0's trainer-side
engine (`weight_sync.network.NetworkSender`, vLLM's `WeightTransferTrainerFactory`) over a gloo group on loopback.

Checks: every version sent loads exactly (greedy tokens and behaviour log-probs equal the transformers forward of
the weights sent, the engine's weight version is ours); names, dtypes or shapes that differ from the model are
refused on both sides before any byte moves, and the old weights keep serving; a generator that never joins fails
the rendezvous within the timeout; a non-loopback bind needs allow_remote.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from async_rlhf.types import SamplingSettings
from async_rlhf.weight_sync import broadcast
from async_rlhf.weight_sync.broadcast import WeightBroadcastError

pytest.importorskip("vllm")

PROMPTS = [[2, 40, 41, 42], [2, 50, 51]]
GREEDY = SamplingSettings(max_new_tokens=8, temperature=0.0, n=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from async_rlhf.generation.engine.vllm_backend import VLLMBackend

    backend = VLLMBackend(tiny_model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def sender(engine):
    """Learner rank 0's channel to the engine: the group forms while vLLM's init route runs (same process here)."""
    from async_rlhf.generation.engine.vllm_backend import LLMClient
    from async_rlhf.weight_sync.network import NetworkSender

    s = NetworkSender(LLMClient(engine.llm), workers=engine.num_workers, timeout=60.0, bucket_bytes=1 << 16)
    s.open()
    yield s
    s.close()


def _perturbed(model_dir: str, seed: int) -> tuple[torch.nn.Module, dict]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def _check_serves(engine, model) -> list[list[int]]:
    out = engine.generate(PROMPTS, GREEDY)
    for prompt, (c,) in zip(PROMPTS, out):
        expected = _forward_logprobs(model, prompt, c.token_ids)
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4), (c.logprobs, expected)
    return [c.token_ids for (c,) in out]


def test_packed_buckets_round_trip_any_dtype_mix():
    """The bucket plan both sides compute, and the byte views, on a mix that misaligns (a bool before floats)."""
    names = ["a", "b", "c", "d", "e"]
    tensors = [torch.tensor([True, False, True]), torch.tensor([1.5, -2.0]),
               torch.tensor([7, -8, 9], dtype=torch.int16), torch.randn(40, dtype=torch.bfloat16),
               torch.tensor([3], dtype=torch.int64)]
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    # with 16-byte buckets: 3 + 8 + 6 bytes reach 16 and close [a, b, c] (b and c land misaligned in it); d's 80 bytes
    # travel alone; e (8) is what is left
    assert broadcast.bucket_plan(dtypes, shapes, 16) == [range(0, 3), range(3, 4), range(4, 5)]
    # a real two-member gloo group on loopback, both ends in this process (the receiver on a thread)
    sock = broadcast.listen("127.0.0.1")
    info = broadcast.GroupInfo(host="127.0.0.1", port=sock.getsockname()[1], rank=1, world_size=2, timeout=60.0,
                               prefix=broadcast.new_prefix(), bucket_bytes=16)
    received = []

    def receive():
        member = broadcast.WeightGroup(info, rank=1)
        assert member.vote(True)
        for bucket in broadcast.receive_packed(member, names, dtypes, shapes, info.bucket_bytes):
            received.extend(bucket)
        member.close()

    thread = threading.Thread(target=receive)
    thread.start()
    root = broadcast.WeightGroup(info, rank=0, listen_socket=sock)
    assert root.vote(True)
    broadcast.send_packed(root, tensors, info.bucket_bytes)
    thread.join(60)
    root.close()
    assert [n for n, _ in received] == names
    for (_, got), want in zip(received, tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_every_version_sent_loads_exactly(engine, sender, tiny_model_dir):
    for version, seed in ((1, 1), (2, 2)):
        model, state = _perturbed(tiny_model_dir, seed)
        sender.send(version, state)  # the trainer-side engine drives vLLM's calls through its client
        assert engine.weight_version == str(version)
        engine.llm.reset_prefix_cache()
        _check_serves(engine, model)


def test_mismatched_updates_are_refused_before_loading_old_weights_kept(engine, sender, tiny_model_dir):
    model, state = _perturbed(tiny_model_dir, 3)
    sender.send(3, state)
    engine.llm.reset_prefix_cache()
    before = _check_serves(engine, model)
    bad_shape = dict(state)
    name = "model.layers.0.mlp.up_proj.weight"
    bad_shape[name] = torch.zeros(bad_shape[name].shape[0] + 1, bad_shape[name].shape[1])
    missing = {k: v for k, v in state.items() if k != name}
    renamed = {("x." + k if k == name else k): v for k, v in state.items()}
    for bad, match in ((bad_shape, "shapes differ"), (missing, "missing"), (renamed, "unexpected")):
        t0 = time.monotonic()
        with pytest.raises(Exception, match=match):
            sender.send(4, bad)
        assert time.monotonic() - t0 < 30  # refused by the vote, not timed out (the group timeout is 60 s)
        assert engine.weight_version == "3"
        engine.llm.reset_prefix_cache()
        assert _check_serves(engine, model) == before
    # the group is still in step: the next good version loads
    model5, state5 = _perturbed(tiny_model_dir, 5)
    sender.send(5, state5)
    engine.llm.reset_prefix_cache()
    _check_serves(engine, model5)


def test_generator_that_never_joins_fails_within_the_timeout():
    from async_rlhf.weight_sync.network import NetworkSender

    class Silent:  # a generator that accepts the init call and never joins the group
        def init_weight_transfer_engine(self, init_info):
            pass

    s = NetworkSender(Silent(), workers=1, timeout=3.0)
    t0 = time.monotonic()
    with pytest.raises(WeightBroadcastError, match="did not form within 3s"):
        s.open()
    assert time.monotonic() - t0 < 30


def test_non_loopback_bind_needs_allow_remote():
    with pytest.raises(ValueError, match="allow_remote"):
        broadcast.listen("0.0.0.0")
    broadcast.listen("0.0.0.0", allow_remote=True).close()
