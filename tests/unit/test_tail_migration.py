"""Tail migration's rule and book-keeping (`experimental/tail_migration.py`), joining a sample's two halves
(`stream_engine.joined`), and the settings it needs. The generators' side runs on real vLLM engines in
`tests/integration/test_tail_handoff_engines.py` and `test_multi_generator.py`."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncOnlineDPOConfig
from async_rlhf.errors import ConfigError
from async_rlhf.generation.engine.stream_engine import _starts, joined
from async_rlhf.experimental.tail_migration import TailMigration
from async_rlhf.types import Completion, GenerationRequest, SamplingSettings
from async_rlhf.errors import FieldError


def _in_flight(holders: dict[int, list[tuple[int, int]]]) -> dict[int, dict]:
    return {g: {key: object() for key in keys} for g, keys in holders.items()}


def test_the_tail_goes_to_the_generator_holding_most_of_it_once_per_batch():
    tail = TailMigration(3)
    flight = _in_flight({0: [(5, 0)], 1: [(5, 1), (5, 2)], 2: [(6, 0)]})
    assert tail.plan(5, flight, starting=set()) == [(0, (5, 0), 1)]  # 3 left on 2 generators: 1 holds most
    assert tail.plan(5, flight, starting=set()) == []  # once per batch
    assert tail.handoffs == 1
    assert tail.arrived((5, 0), tokens=7) == 1 and (tail.moved, tail.moved_tokens) == (1, 7)
    assert tail.arrived((5, 0), tokens=7) is None  # a second answer to the same hand-over changes nothing
    assert tail.stats() == {"generator/tail_handoffs": 1.0, "generator/tail_moved": 1.0,
                            "generator/tail_moved_tokens": 7.0}


@pytest.mark.parametrize("holders,starting,why", [
    ({0: [(5, 0), (5, 1)], 1: [(5, 2), (5, 3)]}, set(), "more than the threshold left"),
    ({0: [(5, 0), (5, 1)], 1: [(6, 0)]}, set(), "the tail is on one generator already"),
    ({0: [(5, 0)], 1: [(5, 1)]}, {1}, "a holder is restarting (it re-samples its requests)"),
    ({0: [], 1: [(6, 0)]}, set(), "nothing of the batch is left"),
])
def test_no_hand_over(holders, starting, why):
    assert TailMigration(3).plan(5, _in_flight(holders), starting) == [], why


def test_ties_go_to_the_lowest_id_and_an_answer_cancels_the_hand_over():
    tail = TailMigration(2)
    assert tail.plan(5, _in_flight({0: [(5, 1)], 1: [(5, 0)]}), set()) == [(1, (5, 0), 0)]
    tail.answered((5, 0))  # its holder finished it before the hand-over arrived
    assert tail.arrived((5, 0), tokens=3) is None and tail.moved == 0
    assert TailMigration(0).plan(5, _in_flight({0: [(5, 1)], 1: [(5, 0)]}), set()) == []  # off
    assert TailMigration(0).stats() == {}


def test_a_sample_joined_across_a_hand_over_keeps_each_token_version_and_logprob():
    before = Completion([1, 2, 3], [-0.1, -0.2, -0.3], "", [[4, 0], [5, 2]])
    after = Completion([7, 8], [-0.7, -0.8], "stop", [[5, 0]])
    assert joined(before, after) == Completion([1, 2, 3, 7, 8], [-0.1, -0.2, -0.3, -0.7, -0.8], "stop",
                                               [[4, 0], [5, 2]])
    newer = Completion([7, 8], [-0.7, -0.8], "length", [[5, 0], [6, 1]])
    assert joined(before, newer).version_starts == [[4, 0], [5, 2], [6, 4]]
    assert joined(Completion([], [], "", []), after) == after  # moved before its first token
    assert _starts([3, 3, 4, 4, 4, 5]) == [[3, 0], [4, 2], [5, 5]] and _starts([]) == []


def test_a_moved_request_never_travels_as_json():
    request = GenerationRequest(0, [1], [[2, 3]], SamplingSettings(max_new_tokens=4, n=1),
                                prefixes=[[Completion([5], [-0.5], "", [[0, 0]])]])
    with pytest.raises(FieldError, match="prefixes"):
        GenerationRequest.from_dict(request.to_dict())
    plain = GenerationRequest(0, [1], [[2, 3]], SamplingSettings(max_new_tokens=4, n=1))
    assert GenerationRequest.from_dict(plain.to_dict()) == plain


@pytest.mark.parametrize("fields,needs", [
    ({}, "at least 2 generator_devices"),
    ({"generator_devices": ["cpu", "cpu"], "weight_load": "drain"}, "weight_load='in_flight'"),
    ({"generator_devices": ["cpu", "cpu"], "generation_mode": "batch"}, "streaming generators"),
    ({"generator_devices": ["cpu", "cpu"], "partial_rollouts": 4}, "partial_rollouts=0"),
    ({"tail_migration": -1}, "integer >= 0"),
])
def test_tail_migration_settings_are_checked_before_anything_starts(tmp_path, fields, needs):
    base = {"tail_migration": 2, "weight_load": "in_flight", "generator_backend": "vllm"}
    with pytest.raises(ConfigError, match="tail_migration") as err:
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), **{**base, **fields})
    assert needs in str(err.value)
