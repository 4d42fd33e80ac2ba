"""The narrow boundaries: the rollout types' one serialisation, the acknowledgement tracker every generator pool
shares (its timeout, which never ran for remote servers before it was shared), and `sequence_terms`."""

import time

import pytest
import torch

from async_rlhf.pipeline.generator_pool import AckTracker
from async_rlhf.errors import StageTimeout
from async_rlhf.types import Completion, GenerationRequest, RolloutBatch, SamplingSettings
from async_rlhf.errors import FieldError

BATCH = RolloutBatch(batch_id=2, generator_id=1, policy_version=1, prompt_ids=[4, 5], prompt_token_ids=[[1, 2], [3]],
                     completions=[[Completion([7, 0], [-0.5, -1.5], "stop")], [Completion([8], [-2.0], "length")]],
                     seconds=0.25, chunk=1, num_chunks=2)


def test_rollout_batch_round_trips_through_json_and_refuses_bad_fields():
    import json

    assert RolloutBatch.from_dict(json.loads(json.dumps(BATCH.to_dict()))) == BATCH
    request = GenerationRequest(3, [4], [[1, 2]], SamplingSettings(max_new_tokens=8, seed=11), chunk=0, num_chunks=1)
    assert GenerationRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request
    with pytest.raises(FieldError, match=r"rollouts.policy_version: expected >= 0"):
        RolloutBatch.from_dict({**BATCH.to_dict(), "policy_version": -1})
    with pytest.raises(FieldError, match=r"unknown field\(s\) \['extra'\]"):
        RolloutBatch.from_dict({**BATCH.to_dict(), "extra": 1})
    bad = BATCH.to_dict()
    bad["completions"][0][0]["logprobs"] = [-0.5]  # one log-prob for two tokens
    with pytest.raises(FieldError, match="token_ids and logprobs differ"):
        RolloutBatch.from_dict(bad)
    with pytest.raises(FieldError, match="2 prompt ids, 1 prompts"):
        RolloutBatch.from_dict({**BATCH.to_dict(), "prompt_token_ids": [[1]]})


def test_ack_tracker_times_out_naming_the_generator_and_skips_restarting_ones():
    acks = AckTracker([0, 1], initial_version=0, timeout=0.05, describe=lambda g: f"server {g} (h:{g})")
    acks.sent(0, 1)
    acks.sent(1, 1)
    acks.acknowledged(0, 1, seconds=0.01)
    acks.overdue()  # not late yet
    time.sleep(0.1)
    with pytest.raises(StageTimeout, match=r"server 1 \(h:1\) did not acknowledge weights v1 within 0s"):
        acks.overdue()
    acks.overdue(exempt={1})  # restarting: it reloads the newest weights anyway
    assert acks.min_loaded_version() == 0 and acks.loaded_version == {0: 1, 1: 0}
    acks.reset(1, 0)
    acks.overdue()
    assert not acks.waiting() and acks.load_seconds == [0.01]


def test_http_pool_check_raises_on_an_unacknowledged_update():
    from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool

    pool = HTTPGeneratorPool(["127.0.0.1:9"], lambda batch: None, None, "/nonexistent", initial_version=0,
                             start_timeout=1.0, weight_sync_timeout=0.05, request_timeout=1.0)
    pool.acks.sent(0, 3)
    pool.check()
    time.sleep(0.1)
    with pytest.raises(StageTimeout, match=r"generator server 0 \(127.0.0.1:9\) did not acknowledge weights v3"):
        pool.check()


def test_sequence_terms_packs_once_for_policy_reference_and_behaviour():
    from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
    from async_rlhf.learner.logprobs import sequence_terms, token_logps
    from async_rlhf.types import ScoredGroup

    tok = char_tokenizer()
    policy, reference = tiny_llama(tok, seed=0), tiny_llama(tok, seed=1)
    groups = [ScoredGroup(0, [5, 6, 7], [Completion([8, 9], [-0.1, -0.2], "length"),
                                         Completion([10], [-0.3], "length")], [1.0, 0.0], 0),
              ScoredGroup(1, [5], [Completion([11, 12, 13], [-0.4, -0.5, -0.6], "length"),
                                   Completion([14], [-0.7], "length")], [0.0, 1.0], 0)]
    t = sequence_terms(policy, reference, groups, select=[(1, 0), (0, 1)], pad_id=tok.pad_token_id, max_length=16,
                       device="cpu", temperature=1.0, sampling_temperature=0.5)
    assert [c.token_ids for c in t.completions] == [[11, 12, 13], [10]]
    assert t.logps.requires_grad and not t.ref_logps.requires_grad and not t.drift_logps.requires_grad
    # behaviour log-probs sit exactly where the mask marks completion tokens, row by row
    assert t.behaviour[t.mask.bool()].tolist() == pytest.approx([-0.4, -0.5, -0.6, -0.3])
    ref, _, _ = token_logps(reference, t.input_ids, t.attention_mask, t.completion_mask)
    assert torch.equal(t.ref_logps, ref)
    # drift at the sampling temperature differs from the loss's temperature-1 log-probs
    hot, _, _ = token_logps(policy, t.input_ids, t.attention_mask, t.completion_mask, temperature=0.5)
    assert torch.allclose(t.drift_logps, hot.detach()) and not torch.allclose(t.drift_logps, t.logps.detach())
