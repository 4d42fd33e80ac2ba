"""Per-prompt completion budgets: a dataset's `max_new_tokens` column (`data/prompts.py`), carried per prompt in a
`GenerationRequest`, and the toy task's heavy-tailed budgets (`toy_prompts(lengths=...)`)."""

from __future__ import annotations

import statistics

import pytest
from datasets import Dataset

from async_rlhf.data.prompts import completion_budgets
from async_rlhf.errors import DatasetError
from async_rlhf.data.toy_task import toy_prompts
from async_rlhf.pipeline.assignment import LengthEstimator
from async_rlhf.types import GenerationRequest, SamplingSettings


def test_budgets_come_from_the_column_for_the_kept_rows_and_bad_ones_are_named():
    data = Dataset.from_dict({"prompt": ["a", "b", "c"], "max_new_tokens": [5, 64, 1]})
    assert completion_budgets(data, [0, 2], 64) == [5, 1]
    assert completion_budgets(Dataset.from_dict({"prompt": ["a"]}), [0], 64) is None
    with pytest.raises(DatasetError, match=r"row 1, column 'max_new_tokens': 64 is not a whole number from 1 to "
                                           r"max_new_tokens = 32"):
        completion_budgets(data, [0, 1], 32)
    for bad in (0, 2.5, True, None):
        with pytest.raises(DatasetError, match="row 0"):
            completion_budgets(Dataset.from_dict({"prompt": ["a"], "max_new_tokens": [bad]}), [0], 64)


def test_a_request_carries_one_budget_per_prompt():
    settings = SamplingSettings(max_new_tokens=64, n=2, seed=1)
    r = GenerationRequest(3, [7, 8], [[1], [2]], settings, max_new_tokens=[5, 9])
    assert GenerationRequest.from_dict(r.to_dict()) == r
    assert r.settings_for(1).max_new_tokens == 9 and r.settings_for(1).seed == 1
    plain = GenerationRequest(3, [7], [[1]], settings)
    assert plain.settings_for(0) is settings
    d = plain.to_dict()
    del d["max_new_tokens"]  # a request written before budgets existed
    assert GenerationRequest.from_dict(d) == plain


def test_toy_budgets_are_heavy_tailed_with_the_asked_mean_and_cap():
    budgets = toy_prompts(4000, seed=0, lengths=(48, 1.0, 224))["max_new_tokens"]
    assert 1 <= min(budgets) and max(budgets) == 224
    assert 42 < statistics.mean(budgets) < 52  # 48, a little less after the cap
    assert 0.8 < statistics.pstdev(budgets) / statistics.mean(budgets) < 1.1
    assert "max_new_tokens" not in toy_prompts(4, seed=0).column_names


def test_the_length_estimate_follows_each_prompts_budget():
    est = LengthEstimator(max_new_tokens=224, budgets=[10, 200, 100])
    assert est.expected_length(0) == 10 and est.expected_length(1) == 200
    est.observe(1, [100, 100])  # half of its budget
    assert est.expected_length(1) == 100 and est.expected_length(2) == 50 and est.expected_length(0) == 5
