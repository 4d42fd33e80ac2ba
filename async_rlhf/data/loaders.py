"""Prompt datasets for users with hub access (TL;DR, GSM8k), local files, and the checks every dataset passes.

Every loader returns a `datasets.Dataset` with our columns: `prompt` (text, or a list of chat messages) and
`reference` (a reference completion), plus loader-specific extras (`completion` for SFT data, `final_answer` for
GSM8k). A loader reads from the hub by name, or from local files given as `data_files` through the same code
path (`load_dataset("json", data_files=...)` instead of `load_dataset(name)`): the tests use the latter on small
fixture files with the hub's columns.

`validate_prompts` is the one place bad rows are handled (see docs/builtin_task.md):
- a missing column, or a prompt that is neither text nor a list of `{"role", "content"}` messages (None
  included): `DatasetFormatError` naming the column, the columns present, or the row index;
- an empty (or whitespace-only) prompt, or one longer than `max_prompt_tokens`: the row is skipped, and the
  count and the first row index are logged; if no row is left, `DatasetFormatError`.
"""

from __future__ import annotations

import logging
import os
import re

from datasets import Dataset, load_dataset

from async_rlhf.data.prompts import is_conversational, prompt_text
from async_rlhf.errors import DatasetError

logger = logging.getLogger(__name__)

TLDR = "trl-lib/tldr"
TLDR_FILTERED = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
GSM8K = "openai/gsm8k"
GSM8K_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"


DatasetFormatError = DatasetError  # one error type for every dataset problem (loading or training)


def load_rows(name: str, split: str = "train", config: str | None = None,
              data_files: str | list[str] | None = None) -> Dataset:
    """`load_dataset(name, config, split=split)`, or the same split read from local `data_files`
    (.json/.jsonl, .csv or .parquet) when they are given."""
    if data_files is None:
        return load_dataset(name, config, split=split)
    first = data_files if isinstance(data_files, str) else data_files[0]
    ext = os.path.splitext(first)[1].lstrip(".").lower()
    builder = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(ext)
    if builder is None:
        raise DatasetFormatError(f"{first}: unsupported file type {ext!r} (use .json, .jsonl, .csv or .parquet)")
    return load_dataset(builder, data_files={split: data_files}, split=split)


def require_columns(dataset: Dataset, columns: list[str], name: str) -> None:
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise DatasetFormatError(f"dataset {name!r} has no column {missing[0]!r} (needs {columns}); "
                                 f"columns present: {dataset.column_names}")


def validate_prompts(dataset: Dataset, name: str, tokenizer=None, max_prompt_tokens: int | None = None,
                     column: str = "prompt") -> Dataset:
    """Check the prompt column, drop empty and over-long prompts (counted and logged), return what is left.

    Over-long is measured in tokens of `tokenizer` (chat prompts through its chat template with the generation
    prompt), so `max_prompt_tokens` needs a tokenizer."""
    require_columns(dataset, [column], name)
    if max_prompt_tokens is not None and tokenizer is None:
        raise ValueError("max_prompt_tokens needs a tokenizer to count tokens with")
    keep: list[int] = []
    empty: list[int] = []
    too_long: list[int] = []
    for i, value in enumerate(dataset[column]):
        if not (isinstance(value, str) or (is_conversational(value) and value)):
            raise DatasetFormatError(
                f"dataset {name!r} row {i}: {column!r} is {type(value).__name__} ({str(value)[:60]!r}); expected "
                "text or a list of {'role', 'content'} chat messages")
        if not (value if isinstance(value, str) else "".join(str(m.get("content", "")) for m in value)).strip():
            empty.append(i)
            continue
        if max_prompt_tokens is not None:
            num_tokens = len(tokenizer(prompt_text(value, tokenizer), add_special_tokens=False)["input_ids"])
            if num_tokens > max_prompt_tokens:
                too_long.append(i)
                continue
        keep.append(i)
    if empty:
        logger.warning("dataset %r: skipped %d rows with an empty %r (first: row %d)", name, len(empty), column,
                       empty[0])
    if too_long:
        logger.warning("dataset %r: skipped %d rows with a %r longer than %d tokens (first: row %d)", name,
                       len(too_long), column, max_prompt_tokens, too_long[0])
    if not keep:
        raise DatasetFormatError(f"dataset {name!r}: no usable rows left ({len(empty)} empty, {len(too_long)} "
                                 f"over {max_prompt_tokens} tokens, of {len(dataset)})")
    return dataset if len(keep) == len(dataset) else dataset.select(keep)


def load_tldr(split: str = "train", data_files=None, tokenizer=None, max_prompt_tokens: int | None = None) -> Dataset:
    """TRL's TL;DR (`trl-lib/tldr`): `prompt` and `completion` (the human summary, also our `reference`)."""
    rows = load_rows(TLDR, split, data_files=data_files)
    require_columns(rows, ["prompt", "completion"], TLDR)
    rows = rows.select_columns(["prompt", "completion"]).map(lambda r: {"reference": r["completion"]})
    return validate_prompts(rows, TLDR, tokenizer, max_prompt_tokens)


def load_tldr_filtered(split: str = "train", data_files=None, tokenizer=None,
                       max_prompt_tokens: int | None = 512) -> Dataset:
    """The paper's TL;DR (`vwxyzjn/..._oai_preprocessing_...`): `query` -> `prompt`, `reference_response` ->
    `reference` and `completion` (trailing "<|endoftext|>" removed). Prompts over `max_prompt_tokens` tokens of
    `tokenizer` are skipped (the paper keeps prompts of at most 512 tokens); without a tokenizer no length filter."""
    rows = load_rows(TLDR_FILTERED, split, data_files=data_files)
    require_columns(rows, ["query", "reference_response"], TLDR_FILTERED)

    def to_ours(row):
        reference = row["reference_response"]
        if isinstance(reference, str) and reference.endswith("<|endoftext|>"):
            reference = reference[:-len("<|endoftext|>")]
        return {"prompt": row["query"], "reference": reference, "completion": reference}

    rows = rows.select_columns(["query", "reference_response"]).map(to_ours, remove_columns=["query",
                                                                                          "reference_response"])
    return validate_prompts(rows, TLDR_FILTERED, tokenizer, max_prompt_tokens if tokenizer is not None else None)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalize_number(text: str) -> str | None:
    """"1,200." -> "1200"; "3.50" -> "3.5"; None when `text` holds no number."""
    match = _NUMBER.search(text or "")
    if match is None:
        return None
    number = match.group(0).replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after the last "####" of a GSM8k solution, normalised; None without one."""
    if "####" not in (solution or ""):
        return None
    return normalize_number(solution.rsplit("####", 1)[1])


def load_gsm8k(split: str = "train", data_files=None, tokenizer=None, max_prompt_tokens: int | None = None) -> Dataset:
    """GSM8k (`openai/gsm8k`, config "main"): `prompt` = "[MATH_TASK] Problem:\\n{question}\\n\\nSolution:",
    `reference` = the worked solution, `final_answer` = its "#### <number>" answer (for `gsm8k_reward`)."""
    rows = load_rows(GSM8K, split, config="main", data_files=data_files)
    require_columns(rows, ["question", "answer"], GSM8K)
    for i, answer in enumerate(rows["answer"]):
        if not isinstance(answer, str) or gsm8k_final_answer(answer) is None:
            raise DatasetFormatError(f"dataset {GSM8K!r} row {i}: 'answer' has no '#### <number>' final answer")
    rows = rows.map(lambda r: {"prompt": GSM8K_PROMPT.format(question=r["question"]), "reference": r["answer"],
                               "final_answer": gsm8k_final_answer(r["answer"])},
                    remove_columns=rows.column_names)
    return validate_prompts(rows, GSM8K, tokenizer, max_prompt_tokens)


def gsm8k_reward(prompts: list, completions: list, final_answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion's "#### <number>" equals the reference answer, else 0.0 (TRL reward signature;
    `final_answer` is the dataset column of that name)."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [float(gsm8k_final_answer(t) is not None and gsm8k_final_answer(t) == normalize_number(a))
            for t, a in zip(texts, final_answer, strict=True)]


def load_prompt_dataset(name: str = "builtin", split: str = "train", data_files=None, tokenizer=None,
                        max_prompt_tokens: int | None = None, seed: int = 0, config: str | None = None) -> Dataset:
    """Prompts for an RLHF run by name: "builtin" (the offline task), the TL;DR and GSM8k hub names above, or a
    local .json/.jsonl/.csv/.parquet file (any name, `data_files` given) with a `prompt` column."""
    if name == "builtin":
        from async_rlhf.data.builtin_task import make_splits

        return validate_prompts(make_splits(seed)[split], name, tokenizer, max_prompt_tokens)
    if name == TLDR:
        return load_tldr(split, data_files, tokenizer, max_prompt_tokens)
    if name == TLDR_FILTERED:
        return load_tldr_filtered(split, data_files, tokenizer, max_prompt_tokens or 512)
    if name == GSM8K:
        return load_gsm8k(split, data_files, tokenizer, max_prompt_tokens)
    if data_files is None and os.path.exists(name):
        data_files = name
    return validate_prompts(load_rows(name, split, config=config, data_files=data_files), name, tokenizer,
                            max_prompt_tokens)
