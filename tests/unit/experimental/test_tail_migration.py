"""Tail migration's rule and book-keeping (`experimental/tail_migration/policy.py`) driven through the pool's seam,
joining a sample's two halves (`experimental/tail_migration/engine.py`), and the settings it needs. The generators' side runs on real vLLM engines in
`tests/integration/test_tail_handoff_engines.py` and `test_multi_generator.py`."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncOnlineDPOConfig
from async_rlhf.errors import ConfigError, FieldError
from async_rlhf.experimental.tail_migration import ContinuedRequest, Migrated, TailHandoff, TailMigration
from async_rlhf.experimental.tail_migration.engine import _starts, joined
from async_rlhf.types import Completion, GenerationRequest, RolloutBatch, SamplingSettings


def _in_flight(holders: dict[int, list[tuple[int, int]]]) -> dict[int, dict]:
    return {g: {key: object() for key in keys} for g, keys in holders.items()}


def test_the_tail_goes_to_the_generator_holding_most_of_it_once_per_batch():
    tail = TailMigration(3)
    flight = _in_flight({0: [(5, 0)], 1: [(5, 1), (5, 2)], 2: [(6, 0)]})
    assert tail.plan_handoffs(5, flight, starting=set()) == [(0, (5, 0), 1)]  # 3 left on 2 generators: 1 holds most
    assert tail.plan_handoffs(5, flight, starting=set()) == []  # once per batch
    assert tail.handoffs == 1
    assert tail.handoff_arrived((5, 0), tokens=7) == 1 and (tail.moved, tail.moved_tokens) == (1, 7)
    assert tail.handoff_arrived((5, 0), tokens=7) is None  # a second answer to the same hand-over changes nothing
    assert tail.stats() == {"generator/tail_handoffs": 1.0, "generator/tail_moved": 1.0,
                            "generator/tail_moved_tokens": 7.0}


@pytest.mark.parametrize("holders,starting,why", [
    ({0: [(5, 0), (5, 1)], 1: [(5, 2), (5, 3)]}, set(), "more than the threshold left"),
    ({0: [(5, 0), (5, 1)], 1: [(6, 0)]}, set(), "the tail is on one generator already"),
    ({0: [(5, 0)], 1: [(5, 1)]}, {1}, "a holder is restarting (it re-samples its requests)"),
    ({0: [], 1: [(6, 0)]}, set(), "nothing of the batch is left"),
])
def test_no_hand_over(holders, starting, why):
    assert TailMigration(3).plan_handoffs(5, _in_flight(holders), starting) == [], why


def test_ties_go_to_the_lowest_id_and_an_answer_cancels_the_hand_over():
    tail = TailMigration(2)
    assert tail.plan_handoffs(5, _in_flight({0: [(5, 1)], 1: [(5, 0)]}), set()) == [(1, (5, 0), 0)]
    tail.request_ended((5, 0))  # its holder finished it before the hand-over arrived
    assert tail.handoff_arrived((5, 0), tokens=3) is None and tail.moved == 0
    assert TailMigration(0).plan_handoffs(5, _in_flight({0: [(5, 1)], 1: [(5, 0)]}), set()) == []  # off
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


class Book:
    """The pool's side of the seam (`pipeline/generator_pool.RequestBook`), in memory."""

    def __init__(self, holders: dict[int, list[tuple[int, int]]], starting=()):
        self.flight = {g: {key: f"request {key}" for key in keys} for g, keys in holders.items()}
        self.starting_now = set(starting)
        self.inboxes: dict[int, list] = {g: [] for g in holders}

    def in_flight(self):
        return self.flight

    def starting(self):
        return self.starting_now

    def put(self, generator_id, message):
        self.inboxes[generator_id].append(message)

    def move(self, key, source, target, request):
        if self.flight[source].pop(key, None) is None:
            return False
        self.flight[target][key] = request
        self.inboxes[target].append(request)
        return True


def _answer(batch: int, chunk: int, generator: int) -> RolloutBatch:
    return RolloutBatch(batch, generator, 0, [], [], [], 0.0, chunk=chunk, num_chunks=4)


def test_through_the_pools_seam_an_answer_sends_the_hand_over_and_the_migrated_request_moves():
    tail, book = TailMigration(3), Book({0: [(5, 0), (5, 3)], 1: [(5, 1), (5, 2)]})
    del book.flight[0][(5, 3)]  # answered: the pool took it out of flight before telling the schedule
    tail.answered(_answer(5, 3, generator=0), book)  # 3 left on 2 generators: 1 holds most
    assert book.inboxes == {0: [TailHandoff(5, 0)], 1: []}
    request = GenerationRequest(5, [0], [[2, 3]], SamplingSettings(max_new_tokens=4, n=1), chunk=0, num_chunks=4)
    moved = ContinuedRequest(request, [[Completion([7], [-0.7], "", [[0, 0]])]])
    assert tail.message(Migrated(0, moved, tokens=1), book)
    assert (5, 0) in book.flight[1] and book.inboxes[1] == [moved] and (tail.moved, tail.moved_tokens) == (1, 1)
    assert not tail.message(_answer(5, 1, generator=1), book)  # not a kind of its own: left to the pool


def test_a_moved_request_never_travels_as_json():
    request = GenerationRequest(0, [1], [[2, 3]], SamplingSettings(max_new_tokens=4, n=1))
    assert GenerationRequest.from_dict(request.to_dict()) == request
    with pytest.raises(FieldError, match="prefixes"):  # a continued request's samples are not a request's field
        GenerationRequest.from_dict({**request.to_dict(), "prefixes": [[]]})
    assert not hasattr(ContinuedRequest, "to_dict")


@pytest.mark.parametrize("fields,needs", [
    ({}, "cannot go with generator_devices=['cpu']: a hand-over needs at least two generators"),
    ({"generator_devices": ["cpu", "cpu"], "weight_load": "drain"}, "cannot go with weight_load='drain'"),
    ({"generator_devices": ["cpu", "cpu"], "generation_mode": "batch"}, "cannot go with generation_mode='batch'"),
    ({"generator_devices": ["cpu", "cpu"], "partial_rollouts": 4}, "cannot go with partial_rollouts=4"),
    ({"tail_migration": -1}, "integer >= 0"),
])
def test_tail_migration_settings_are_checked_before_anything_starts(tmp_path, fields, needs):
    base = {"tail_migration": 2, "weight_load": "in_flight", "generator_backend": "vllm"}
    with pytest.raises(ConfigError, match="tail_migration") as err:
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), **{**base, **fields})
    assert needs in str(err.value)
