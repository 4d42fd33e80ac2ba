"""The streaming boundary's small parts: length-aware assignment (`pipeline/assignment.py`) and per-token versions
on the rollout types (`Completion.version_starts`, `RolloutBatch.sample_versions`)."""

from __future__ import annotations

import pytest

from async_rlhf.pipeline.assignment import LengthEstimator, assign, imbalance
from async_rlhf.types import Completion, RolloutBatch
from async_rlhf.errors import FieldError


def test_longest_first_to_the_least_loaded_generator_counting_work_in_flight():
    assert assign([10, 1, 1, 8], [0, 0]) == [0, 1, 1, 1]  # 10 | 8+1+1
    assert assign([5, 5], [100, 0]) == [1, 1]  # generator 0 is still busy with a long tail
    costs = [200, 10, 12, 9, 180, 11, 8, 10]
    owners = assign(costs, [0, 0])
    loads = [sum(c for c, o in zip(costs, owners) if o == g) for g in (0, 1)]
    assert max(loads) / (sum(loads) / 2) < 1.05


def test_imbalance_as_assigned_and_as_count_chunks():
    tokens = [200, 10, 12, 9, 180, 11, 8, 10]  # count chunks: 231 | 209
    assigned, counted = imbalance(tokens, assign(tokens, [0, 0]), 2)
    assert counted == pytest.approx(231 / 220)
    assert assigned <= counted
    assert imbalance([5, 5], [0, 0], 2) == (2.0, 1.0)


def test_length_estimate_per_prompt_then_the_share_of_the_budget_used_then_the_budget():
    est = LengthEstimator(max_new_tokens=128)
    assert est.expected_length(3) == 128
    est.observe(3, [10, 30])  # a sixth of the budget used
    assert est.expected_length(3) == 20 and est.expected_length(4) == pytest.approx(128 * 40 / 256)
    est.observe(4, [100])
    assert est.expected_length(4) == 100 and est.expected_length(5) == pytest.approx(128 * 140 / 384)


def test_version_starts_round_trip_and_are_checked():
    c = Completion([5, 6, 7], [-1.0, -2.0, -3.0], "length", version_starts=[[3, 0], [4, 2]])
    batch = RolloutBatch(0, 0, 3, [9], [[1, 2]], [[c, Completion([5], [-1.0], "stop")]], 0.1)
    assert RolloutBatch.from_dict(batch.to_dict()) == batch
    assert batch.sample_versions() == [[[3, 4], [3, 3]]]
    old = {"token_ids": [5], "logprobs": [-1.0], "finish_reason": "stop"}  # a checkpoint from before the field
    assert Completion.from_dict(old).version_starts == []
    for bad in ([[3, 1]], [[3, 0], [4]], [[3, 0], [4, 5], [5, 2]]):
        with pytest.raises(FieldError, match="version_starts"):
            Completion.from_dict({**old, "version_starts": bad})
