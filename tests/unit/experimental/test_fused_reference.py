"""Reference log-probs computed on the scoring thread as parts arrive (`experimental/fused_reference.py`) must be what the
learner's step computes itself, must survive the trip to other ranks and checkpoints, and must replace the step's
reference forward only when they fit; the scoring stage accounts each stage's time and hidden fraction."""

import random
import threading
import time

import pytest
import torch

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.errors import FieldError
from async_rlhf.experimental.fused_reference import reference_parts
from async_rlhf.learner.logprobs import REFERENCE, sequence_terms
from async_rlhf.scoring.stage import ScoringStage
from async_rlhf.types import Completion, RolloutBatch, ScoredGroup

TOK = char_tokenizer()
REF = tiny_llama(TOK, seed=0).eval()
POLICY = tiny_llama(TOK, seed=1).eval()
OTHER = tiny_llama(TOK, seed=2).eval()  # a different "reference": shows which one the step used


def part(batch_id: int, chunk: int, num_chunks: int, n: int, prompts: int = 3, seed: int = 0) -> RolloutBatch:
    rng = random.Random(seed)
    groups, prompt_ids = [], []
    for _ in range(prompts):  # prompts and completions of different lengths: padding and buckets differ
        prompt_ids.append([rng.randrange(4, 90) for _ in range(rng.randint(2, 20))])
        group = []
        for _ in range(n):
            tokens = [rng.randrange(4, 90) for _ in range(rng.randint(1, 12))]
            group.append(Completion(tokens, [-1.0] * len(tokens), "length"))
        groups.append(group)
    return RolloutBatch(batch_id, 0, 0, list(range(chunk * prompts, (chunk + 1) * prompts)), prompt_ids, groups, 0.1,
                        chunk=chunk, num_chunks=num_chunks)


def groups_of(batch: RolloutBatch) -> list[ScoredGroup]:
    return [ScoredGroup(pid, p, g, [0.0] * len(g), batch.policy_version)
            for pid, p, g in zip(batch.prompt_ids, batch.prompt_token_ids, batch.completions)]


def fused(parts, max_length=64, temperature=1.0, shared_prefix=False):
    return reference_parts(parts, REF, pad_id=TOK.pad_token_id, max_length=max_length, device="cpu",
                           temperature=temperature, shared_prefix=shared_prefix)


@pytest.mark.parametrize("n, temperature, shared_prefix, max_length, dpo_rows", [
    (2, 1.0, True, 64, True),  # online DPO on the built-in task: chosen and rejected rows, shared prompt prefix
    (4, 0.7, False, 64, False),  # a policy-gradient learner: every row at the sampling temperature
    (8, 1.0, True, 24, False),  # rows cut to max_length: the shared prefix falls back, here as in the step
])
def test_carried_reference_equals_the_steps_own(n, temperature, shared_prefix, max_length, dpo_rows):
    parts = [part(5, c, 2, n, seed=c) for c in range(2)]  # two parts scored in one call, as they arrived
    scored = fused(parts, max_length, temperature, shared_prefix)
    # to other ranks and into checkpoints as JSON
    batch = RolloutBatch.from_dict(RolloutBatch(
        5, -1, 0, [i for p in scored for i in p.prompt_ids], [t for p in scored for t in p.prompt_token_ids],
        [g for p in scored for g in p.completions], 0.1).to_dict())
    groups = groups_of(batch)
    select = None
    if dpo_rows:  # chosen rows, then rejected rows, in the step's order
        select = [(g, 1) for g in range(len(groups))] + [(g, 0) for g in range(len(groups))]
    kw = dict(pad_id=TOK.pad_token_id, max_length=max_length, device="cpu", temperature=temperature,
              sampling_temperature=temperature, select=select, shared_prefix=shared_prefix)
    own = sequence_terms(POLICY, REF, [g for p in parts for g in groups_of(p)], **kw)  # as arrived: none carried
    carried = sequence_terms(POLICY, OTHER, groups, fused_temperature=temperature, **kw)
    assert torch.equal(carried.ref_logps == 0, own.ref_logps == 0)  # the same positions
    assert torch.allclose(carried.ref_logps, own.ref_logps, atol=1e-5), (carried.ref_logps - own.ref_logps).abs().max()
    assert torch.equal(carried.logps, own.logps)  # the policy's side is untouched
    # the step did not run its own reference (OTHER would have given other values)
    ignored = sequence_terms(POLICY, OTHER, groups, **kw)  # fused_temperature None: carried values never used
    assert not torch.allclose(ignored.ref_logps, own.ref_logps, atol=1e-3)


def test_carried_values_are_used_only_when_they_fit():
    scored = fused([part(0, 0, 1, 2)])[0]
    groups = groups_of(scored)
    kw = dict(pad_id=TOK.pad_token_id, max_length=64, device="cpu", sampling_temperature=1.0)
    own = sequence_terms(POLICY, OTHER, groups, temperature=1.0, **kw).ref_logps
    carried = sequence_terms(POLICY, OTHER, groups, temperature=1.0, fused_temperature=1.0, **kw).ref_logps
    assert not torch.allclose(own, carried, atol=1e-3)
    # computed at another temperature than the loss's: the step computes its own
    assert torch.equal(sequence_terms(POLICY, OTHER, groups, temperature=0.7, fused_temperature=1.0, **kw).ref_logps,
                       sequence_terms(POLICY, OTHER, groups, temperature=0.7, **kw).ref_logps)
    # one row without them (a batch from an older checkpoint, a non-finite value left out): the step's own for all
    groups[1].completions[0] = Completion(groups[1].completions[0].token_ids, groups[1].completions[0].logprobs,
                                          "length")
    assert torch.equal(sequence_terms(POLICY, OTHER, groups, temperature=1.0, fused_temperature=1.0, **kw).ref_logps,
                       own)


def test_a_completion_refuses_more_reference_values_than_tokens():
    d = Completion([5, 6], [-1.0, -1.0], "stop", token_values={REFERENCE: [-0.5, -0.25, -2.0]}).__dict__
    with pytest.raises(FieldError, match="token_values\\['ref_logprobs'\\]: 3 values for 2 tokens"):
        Completion.from_dict(dict(d))
    older = {k: v for k, v in d.items() if k not in ("token_values", "version_starts")}  # an older checkpoint
    assert Completion.from_dict(older).token_values == {}
    # one written while the values had a field of their own: read into today's
    assert Completion.from_dict({**older, "ref_logprobs": [-0.5, -0.25]}).token_values == {REFERENCE: [-0.5, -0.25]}
    assert Completion.from_dict({**older, "ref_logprobs": []}).token_values == {}


def test_each_stage_is_timed_and_only_work_after_a_batchs_last_part_counts_as_exposed():
    """Two parts of one batch, the second submitted once the first went through both stages: the first part's
    stage time is hidden (its batch was incomplete), the second's exposed: each stage's hidden fraction is its first
    call's time over both calls' (about 1/2; timed here too, since a loaded machine oversleeps)."""
    done, assembled, calls = threading.Event(), [], {"reward": [], "reference": []}

    def slow(name):
        def run(parts):
            t0 = time.perf_counter()
            time.sleep(0.05)
            calls[name].append(time.perf_counter() - t0)
            return parts
        return run

    def assemble(p):
        assembled.append(p.chunk)
        done.set()
        return len(assembled) == 2

    stage = ScoringStage([("reward", slow("reward")), ("reference", slow("reference"))], assemble)
    try:
        stage.submit(part(0, 0, 2, 2))
        assert done.wait(5.0)
        done.clear()
        stage.submit(part(0, 1, 2, 2))
        assert done.wait(5.0)
    finally:
        stage.close()
    stats = stage.stats()
    assert assembled == [0, 1]
    for name in ("reward", "reference"):
        assert stats[f"scoring/{name}_seconds"] >= 0.09
        first, second = calls[name]
        assert stats[f"scoring/{name}_hidden_fraction"] == pytest.approx(first / (first + second), abs=0.03), stats
    assert stats["scoring/seconds"] == pytest.approx(stats["scoring/reward_seconds"] + stats["scoring/reference_seconds"])
