"""NaN and +-inf are refused where numbers come from outside a process (generator-server answers, messages from other
ranks, checkpoints) and are never written by us; a locally generated batch with a non-finite behaviour log-prob fails
on rank 0 naming its generator."""

from __future__ import annotations

import math
import os

import pytest

from async_rlhf.learner import checkpointing
from async_rlhf.generation.pool import http_client
from async_rlhf.errors import GeneratorFailed
from async_rlhf.pipeline.rank_share import check_logprobs_finite
from async_rlhf.types import Completion, GenerationRequest, RolloutBatch, SamplingSettings
from async_rlhf.errors import FieldError

SETTINGS = SamplingSettings(max_new_tokens=4, temperature=0.9, top_p=1.0, top_k=-1, n=1, seed=7)
REQUEST = GenerationRequest(batch_id=3, prompt_ids=[5], prompt_token_ids=[[2, 40]], settings=SETTINGS)


def batch(logprob: float, generator_id: int = 2) -> RolloutBatch:
    return RolloutBatch(batch_id=3, generator_id=generator_id, policy_version=2, prompt_ids=[5],
                        prompt_token_ids=[[2, 40]], completions=[[Completion([4, 1], [-0.5, logprob], "stop")]],
                        seconds=0.5)


def choice(logprobs: list, index: int = 0, spans=None) -> dict:
    tokens = [4, 1][:len(logprobs)]
    return {"index": index, "token_ids": tokens, "finish_reason": "stop",
            "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, logprobs)]},
            "weight_versions": spans or [{"version": "default", "start": 0, "end": len(tokens)}]}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_server_answers_with_nan_or_infinity_are_refused(constant):
    text = '{"choices": [{"index": 0, "token_ids": [4], "logprobs": {"content": [{"logprob": %s}]}}]}' % constant
    with pytest.raises(http_client.ServerError, match=f"not valid JSON.*non-finite number {constant}"):
        http_client.parse_json(text, "/inference/v1/generate")


@pytest.mark.parametrize("value", [None, -9999.0, "-1.0", True, math.nan])
def test_completions_with_a_non_finite_logprob_are_refused(value):
    """vLLM writes NaN as null and clamps -inf to -9999.0; a string or bool is not a log-prob either."""
    assert http_client.parse_generated({"choices": [choice([-0.5, -1.0])]}, 1, 0)[0].logprobs == [-0.5, -1.0]
    with pytest.raises(http_client.ServerError, match=r"non-finite behaviour log-prob .* sample 0, token 1"):
        http_client.parse_generated({"choices": [choice([-0.5, value])]}, 1, 0)


def test_generated_tokens_carry_their_weight_versions():
    """vLLM's spans become `version_starts` ("default" is the server's start-up policy); spans that do not cover a
    sample from its first token, or a label that is not a policy version, are refused."""
    spans = [{"version": "default", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 2}]
    (c,) = http_client.parse_generated({"choices": [choice([-0.5, -1.0], spans=spans)]}, 1, default_version=2)
    assert c.version_starts == [[2, 0], [3, 1]] and c.oldest_version(9) == 2
    for bad in ([{"version": "3", "start": 1, "end": 2}], [{"version": "latest", "start": 0, "end": 2}]):
        with pytest.raises(http_client.ServerError, match="weight version|do not start at token 0"):
            http_client.parse_generated({"choices": [choice([-0.5, -1.0], spans=bad)]}, 1, 0)


@pytest.mark.parametrize("change, message", [
    ({"temperature": math.nan}, "settings.temperature: expected a finite number, got nan"),
    ({"top_p": math.inf}, "settings.top_p: expected a finite number, got inf"),
    ({"top_p": 0.0}, r"top_p 0.0 in \(0, 1\]"),
    ({"temperature": -1.0}, "temperature -1.0 must be >= 0"),
])
def test_requests_with_non_finite_or_out_of_range_settings_are_refused(change, message):
    frame = REQUEST.to_dict()
    frame["settings"] = {**frame["settings"], **change}
    with pytest.raises(FieldError, match=message):
        GenerationRequest.from_dict(frame)


def test_checkpoint_is_written_and_read_as_strict_json(tmp_path):
    identity = {"model": "m", "num_prompts": 4, "prompts_per_step": 1, "seed": 0}
    with pytest.raises(ValueError, match="not JSON compliant"):  # never written
        checkpointing.save_pipeline_state(str(tmp_path), 3, [batch(math.nan)], {}, identity)
    checkpointing.save_pipeline_state(str(tmp_path), 3, [batch(-1.0)], {}, identity)
    checkpointing.mark_complete(str(tmp_path), 3)
    assert checkpointing.load_pipeline_state(str(tmp_path), identity)["pending"] == [batch(-1.0)]
    path = os.path.join(tmp_path, checkpointing.PIPELINE_FILE)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:  # a file edited (or written by an older version) with a -inf log-prob
        f.write(text.replace("-1.0", "-Infinity"))
    with pytest.raises(checkpointing.CheckpointError, match="expected a finite number, got -inf"):
        checkpointing.load_pipeline_state(str(tmp_path), identity)


def test_a_local_batch_with_a_non_finite_logprob_fails_naming_the_generator():
    check_logprobs_finite(batch(-1.0))
    with pytest.raises(GeneratorFailed, match=r"generator 2: batch 3 \(policy version 2\) has a non-finite behaviour "
                                              r"log-prob -inf at prompt 5, completion 0, token 1"):
        check_logprobs_finite(batch(-math.inf))
