"""The sorting task: deterministic splits, careless demonstrations, exact references, and a gold reward worked by
hand."""

import pytest

from async_rlhf.data import sorting_task as task
from async_rlhf.data.tokenizer import build_tokenizer

PROMPT = "SORT: 3 1 2 1 ="  # answer " 1 1 2 3."


@pytest.mark.parametrize("completion, truncated, expected", [
    (" 1 1 2 3.", False, 2.0),  # exact, stopped
    (" 1 1 2 3.", True, 1.0),  # exact digits, cut at the token limit: no bonus
    (" 1 1 2 3", False, 1.0),  # no period: did not stop cleanly
    (" 1 2 1 3.", False, 0.5),  # two neighbours swapped: positions 0 and 3 right
    (" 1 2 3.", False, 0.25),  # a digit dropped shifts the rest: only position 0 right, over 4
    (" 1 1 2 3 3.", False, 0.8),  # one too many: 4 right over 5
    (" 1 1. 2 3.", False, 1.0),  # two periods: all digits right, no bonus
    ("", False, 0.0),
])
def test_gold_reward_by_hand(completion, truncated, expected):
    assert task.gold_reward([PROMPT], [completion], truncated=[truncated]) == [pytest.approx(expected)]


def test_splits_are_deterministic_and_references_exact():
    a = task.make_splits(3, sizes={"train": 50, "validation": 0, "test": 20})
    b = task.make_splits(3, sizes={"train": 50, "validation": 0, "test": 5})
    assert a["train"]["prompt"] == b["train"]["prompt"] and a["test"]["prompt"][:5] == b["test"]["prompt"]
    assert a["train"]["prompt"] != task.make_splits(4, sizes={"train": 50})["train"]["prompt"]
    for row in a["train"]:
        digits = task.prompt_digits(row["prompt"])
        assert task.MIN_DIGITS <= len(digits) <= task.MAX_DIGITS
        assert task.gold_reward([row["prompt"]], [row["reference"]]) == [2.0]


def test_demonstrations_are_careless_but_close():
    rows = task.make_splits(0, sizes={"train": 2000, "validation": 0, "test": 0})["train"]
    scores = task.gold_reward(rows["prompt"], rows["completion"])
    exact = sum(s == 2.0 for s in scores) / len(scores)
    assert 0.2 < exact < 0.35  # a quarter have no slip
    assert sum(scores) / len(scores) > 1.0


def test_every_digit_is_one_token():
    tokenizer = build_tokenizer(512, vocabulary=task.VOCABULARY)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    answer = tokenizer(" 1 1 2 3.", add_special_tokens=False)["input_ids"]
    assert len(prompt) == 2 + 4 + 1  # " SORT", ":", four digits, " ="
    assert len(answer) == 5 and tokenizer.decode(answer) == " 1 1 2 3."
