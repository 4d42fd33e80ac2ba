"""Weights that arrive while a request's episodes run (`weight_load='in_flight'`, batch-level serving): the generator's
serve loop loads them between two turns, the turns after the load are sampled by the new weights, and each episode
records which tokens each version sampled (`Completion.version_starts`), with the behaviour log-prob of the version
that sampled the token.

Real sampling with the transformers backend in this process (`serve_loops.serve_batches`, the loop a generator process
runs), the guessing task's environment and conftest.py's tool-calling `guess_policy`; the update is queued behind the
request, as the learner queues the weights of a step that ends while the generator plays the next batch."""

from __future__ import annotations

import queue

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rlhf.data import guess_task as g
from async_rlhf.generation.engine import load_backend
from async_rlhf.generation.engine.episodes import EpisodeSpec
from async_rlhf.generation.engine.serve_loops import serve_batches
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.trainers.multi_turn import MultiTurn
from async_rlhf.types import GenerationRequest, RolloutBatch, SamplingSettings, Shutdown, WeightAck
from async_rlhf.weight_sync.shm import ShmWeightTransport

TOLERANCE = 2e-3  # cached decoding against one forward over the whole episode (observed below 1e-5)


def episode_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(token | everything before it) of each completion token under `model`, one forward over the episode (each
    turn's prompt is exactly the ids before it: token in, token out)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_a_weight_update_between_turns_samples_the_later_turns_and_is_recorded_per_token(guess_policy, tmp_path):
    multi = MultiTurn(environment_factory=g.GuessEnv)
    tokenizer = multi.prepare_tokenizer(AutoTokenizer.from_pretrained(guess_policy))
    prompts, _, rows = multi.prompt_ids(g.make_split(4, 0, "train"), tokenizer, 256, {})
    episodes = EpisodeSpec(tokenizer=multi.rendering_tokenizer(tokenizer), environment_factories=multi.factories,
                           max_completion_length=160, max_tool_calling_iterations=5, max_model_len=512)
    spec = GeneratorSpec(generator_id=0, backend="transformers", model_path=guess_policy, device="cpu", seed=0,
                         threads=1, weight_load="in_flight", episodes=episodes)
    old = AutoModelForCausalLM.from_pretrained(guess_policy).eval()
    new = AutoModelForCausalLM.from_pretrained(guess_policy).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.02 * torch.randn_like(p))
    transport = ShmWeightTransport(str(tmp_path))
    inbox, outbox = queue.Queue(), queue.Queue()
    inbox.put(GenerationRequest(batch_id=0, prompt_ids=list(range(len(prompts))), prompt_token_ids=prompts,
                                settings=SamplingSettings(max_new_tokens=160, n=2, seed=5), rows=rows))
    inbox.put(transport.publish({k: v.detach().clone() for k, v in new.state_dict().items()}, 1))  # behind it
    inbox.put(Shutdown())
    backend = load_backend("transformers", guess_policy, device="cpu", seed=0)
    try:
        assert serve_batches(spec, backend, inbox, outbox, None)
    finally:
        backend.close()
        transport.close()
    ack, batch = outbox.get_nowait(), outbox.get_nowait()
    assert isinstance(ack, WeightAck) and ack.version == 1  # loaded while the episodes ran, before they ended
    assert isinstance(batch, RolloutBatch) and batch.policy_version == 0  # the oldest token's version
    spanning = 0
    for p, group in enumerate(batch.completions):
        for c in group:
            sampled = torch.tensor(c.mask, dtype=torch.bool)
            behaviour = torch.tensor(c.logprobs)
            prompt = c.prompt_token_ids or batch.prompt_token_ids[p]
            if c.episode["turns"] == 1:  # answered at once: one version, nothing recorded
                assert c.version_starts == []
                continue
            spanning += 1
            second = next(i for i in range(1, len(c.mask)) if c.mask[i] and not c.mask[i - 1])  # turn 2's first
            assert c.version_starts == [[0, 0], [1, second]]
            first_turn, later = sampled.clone(), sampled.clone()
            first_turn[second:], later[:second] = False, False
            for model, tokens, name in ((old, first_turn, "turn 1, version 0"), (new, later, "later turns, version 1")):
                logps = episode_logps(model, prompt, c.token_ids)
                gap = (logps - behaviour)[tokens].abs().max().item()
                assert gap < TOLERANCE, f"{name}: behaviour log-probs differ from the version's own by {gap:.2e}"
            # ... and the later turns were not sampled by the old weights
            assert (episode_logps(old, prompt, c.token_ids) - behaviour)[later].abs().max().item() > 10 * TOLERANCE
    assert spanning > 0, "no episode took a second turn: the policy never called its tool"
