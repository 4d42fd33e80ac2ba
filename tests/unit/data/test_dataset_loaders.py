"""Hub dataset loaders, run offline on small fixture files with the hub's columns (same code path as the hub)."""

import os
import pathlib

import pytest
from datasets import Dataset

from async_rlhf.data import loaders
from async_rlhf.data.tokenizer import build_tokenizer

FIXTURES = next(str(p / "tests" / "fixtures" / "datasets") for p in pathlib.Path(__file__).resolve().parents
                if (p / "pyproject.toml").exists())


def fixture(name):
    return os.path.join(FIXTURES, name)


def test_tldr_maps_completion_to_reference_and_skips_empty_prompt(caplog):
    rows = loaders.load_prompt_dataset(loaders.TLDR, data_files=fixture("tldr.jsonl"))
    assert len(rows) == 2  # the whitespace-only prompt is skipped, and logged
    assert "skipped 1 rows with an empty 'prompt' (first: row 2)" in caplog.text
    assert rows[0]["reference"] == " cat knocks cups off table" == rows[0]["completion"]
    assert rows[0]["prompt"].endswith("TL;DR:")


def test_tldr_filtered_renames_strips_eos_and_skips_long_prompts(caplog):
    tok = build_tokenizer()
    rows = loaders.load_prompt_dataset(loaders.TLDR_FILTERED, data_files=fixture("tldr_filtered.jsonl"),
                                       tokenizer=tok)
    assert rows.column_names == ["prompt", "reference", "completion"]
    assert len(rows) == 1  # the 80x repeated post is over 512 tokens: skipped
    assert "longer than 512 tokens (first: row 1)" in caplog.text
    assert rows[0]["reference"] == " dog ate homework"


def test_gsm8k_prompt_format_answer_and_exact_match_reward():
    rows = loaders.load_prompt_dataset(loaders.GSM8K, data_files=fixture("gsm8k.jsonl"))
    assert rows[0]["prompt"] == ("[MATH_TASK] Problem:\nTom has 3 apples and buys 4 more. How many apples does he "
                                 "have?\n\nSolution:")
    assert rows["final_answer"] == ["7", "600"]
    scores = loaders.gsm8k_reward(prompts=rows["prompt"], completions=[" 3+4=7\n#### 7", " half: #### 600.00"],
                                  final_answer=rows["final_answer"])
    assert scores == [1.0, 1.0]
    assert loaders.gsm8k_reward(prompts=["p"] * 2, completions=["#### 8", "seven"], final_answer=["7", "7"]) == \
        [0.0, 0.0]


def test_gsm8k_without_final_answer_names_the_row():
    with pytest.raises(loaders.DatasetFormatError, match=r"row 0: 'answer' has no '#### <number>'"):
        loaders.load_prompt_dataset(loaders.GSM8K, data_files=fixture("gsm8k_no_answer.jsonl"))


def test_wrong_columns_name_the_missing_column_and_the_ones_present():
    with pytest.raises(loaders.DatasetFormatError, match=r"no column 'prompt'.*columns present: \['text', 'label'\]"):
        loaders.load_prompt_dataset("my_prompts", data_files=fixture("wrong_columns.jsonl"))
    with pytest.raises(loaders.DatasetFormatError, match="no column 'query'"):
        loaders.load_prompt_dataset(loaders.TLDR_FILTERED, data_files=fixture("tldr.jsonl"))


def test_non_string_prompt_and_all_empty_are_errors_naming_the_row():
    with pytest.raises(loaders.DatasetFormatError, match=r"row 1: 'prompt' is NoneType"):
        loaders.validate_prompts(Dataset.from_dict({"prompt": ["fine", None]}), "mine")
    with pytest.raises(loaders.DatasetFormatError, match="no usable rows left"):
        loaders.validate_prompts(Dataset.from_dict({"prompt": ["", "  "]}), "mine")


def test_unsupported_file_type():
    with pytest.raises(loaders.DatasetFormatError, match="unsupported file type 'txt'"):
        loaders.load_rows("x", data_files="prompts.txt")
