"""NaN and +-inf are refused where numbers come from outside a process (generator-server frames, messages from other
ranks, checkpoints) and are never written by us; a locally generated batch with a non-finite behaviour log-prob fails
on rank 0 naming its generator."""

from __future__ import annotations

import math
import os
import socket

import pytest

from async_rlhf import checkpointing
from async_rlhf.generation import wire
from async_rlhf.generation.pool_protocol import GeneratorFailed
from async_rlhf.pipeline import check_logprobs_finite
from async_rlhf.types import Completion, FieldError, GenerationRequest, RolloutBatch, SamplingSettings
from async_rlhf.weight_sync.broadcast import GroupInfo

SETTINGS = SamplingSettings(max_new_tokens=4, temperature=0.9, top_p=1.0, top_k=-1, n=1, seed=7)
REQUEST = GenerationRequest(batch_id=3, prompt_ids=[5], prompt_token_ids=[[2, 40]], settings=SETTINGS)


def batch(logprob: float, generator_id: int = 2) -> RolloutBatch:
    return RolloutBatch(batch_id=3, generator_id=generator_id, policy_version=2, prompt_ids=[5],
                        prompt_token_ids=[[2, 40]], completions=[[Completion([4, 1], [-0.5, logprob], "stop")]],
                        seconds=0.5)


def test_frames_with_nan_or_infinity_are_refused():
    for constant in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"kind":"rollouts","seconds":' + constant + b"}"
        a, b = socket.socketpair()
        with a, b:
            a.sendall(len(body).to_bytes(4, "big") + body)
            with pytest.raises(wire.ProtocolError, match=f"frame holds {constant.decode()}"):
                wire.recv_frame(b)


def test_we_never_send_a_non_finite_number():
    a, b = socket.socketpair()
    with a, b, pytest.raises(ValueError, match="not JSON compliant"):
        wire.send_frame(a, {"kind": "rollouts", "seconds": math.nan})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_rollouts_with_a_non_finite_logprob_are_refused_naming_the_field(value):
    frame = {**batch(-1.0).to_dict(), "kind": "rollouts", "prompt_token_ids": []}
    frame["completions"][0][0]["logprobs"][1] = value  # as a peer's json.loads would produce it
    with pytest.raises(FieldError, match=rf"completion.logprobs: expected a finite number, got {value}"):
        wire.decode_rollouts(frame, REQUEST, generator_id=0)


@pytest.mark.parametrize("change, message", [
    ({"temperature": math.nan}, "settings.temperature: expected a finite number, got nan"),
    ({"top_p": math.inf}, "settings.top_p: expected a finite number, got inf"),
    ({"top_p": 0.0}, r"top_p 0.0 in \(0, 1\]"),
    ({"temperature": -1.0}, "temperature -1.0 must be >= 0"),
])
def test_requests_with_non_finite_or_out_of_range_settings_are_refused(change, message):
    frame = wire.encode_request(REQUEST)
    frame["settings"] = {**frame["settings"], **change}
    with pytest.raises(FieldError, match=message):
        wire.decode_request(frame)


def test_group_info_with_an_infinite_timeout_is_refused():
    info = GroupInfo(host="127.0.0.1", port=2345, rank=1, world_size=2, backend="gloo", timeout=10.0, prefix="p/")
    for bad in (math.inf, math.nan, 0.0):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            GroupInfo.from_dict({**info.to_dict(), "timeout": bad})


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
