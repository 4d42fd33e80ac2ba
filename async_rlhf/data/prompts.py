"""Turning a prompt dataset into token ids, with the checks that must pass before any model loads."""

from __future__ import annotations

import logging
from async_rlhf.errors import DatasetError

logger = logging.getLogger(__name__)


def check_prompt_dataset(dataset, name: str = "train_dataset") -> None:
    """Checks that need no tokenizer: exists, non-empty, has a `prompt` column, every prompt is non-empty text
    or a list of chat messages. Errors name the row."""
    if dataset is None:
        raise DatasetError(f"{name}: a dataset with a 'prompt' column is required")
    columns = list(getattr(dataset, "column_names", None) or [])
    if "prompt" not in columns:
        raise DatasetError(f"{name}: no 'prompt' column (columns: {columns})")
    if len(dataset) == 0:
        raise DatasetError(f"{name}: the dataset is empty")
    for row, prompt in enumerate(dataset["prompt"]):
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DatasetError(f"{name}: row {row}: empty prompt")
        elif not is_conversational(prompt):
            raise DatasetError(f"{name}: row {row}: 'prompt' must be text or a list of chat messages "
                               f"({{'role': ..., 'content': ...}}), got {type(prompt).__name__}")
        elif not prompt:
            raise DatasetError(f"{name}: row {row}: empty conversation")


def is_conversational(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in prompt)


def prompt_text(prompt, tokenizer) -> str:
    """The exact text the policy is conditioned on (chat template applied to conversational prompts)."""
    if is_conversational(prompt):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def tokenize_prompts(dataset, tokenizer, max_prompt_length: int, name: str = "train_dataset"):
    """Returns (token ids per kept row, kept row indices). Empty or non-text prompts are errors naming the row;
    prompts longer than `max_prompt_length` tokens are skipped, counted and logged (an error if none remain)."""
    check_prompt_dataset(dataset, name)
    ids, kept, too_long = [], [], []
    for row, prompt in enumerate(dataset["prompt"]):
        text = prompt_text(prompt, tokenizer)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) > max_prompt_length:
            too_long.append(row)
            continue
        ids.append(tokens)
        kept.append(row)
    if too_long:
        logger.warning("%s: skipped %d prompt(s) longer than %d tokens (rows %s%s)", name, len(too_long),
                       max_prompt_length, too_long[:10], "..." if len(too_long) > 10 else "")
    if not ids:
        raise DatasetError(f"{name}: every prompt is longer than max_length - max_new_tokens = "
                           f"{max_prompt_length} tokens")
    return ids, kept


BUDGET_COLUMN = "max_new_tokens"


def completion_budgets(dataset, rows: list[int], max_new_tokens: int, name: str = "train_dataset") -> list[int] | None:
    """Each kept row's own completion budget, from an optional `max_new_tokens` column (a whole number from 1 to the
    config's `max_new_tokens`), in the order of `rows`; None without the column. A bad value is an error naming the
    row, the value and the limit, raised before any model loads."""
    if BUDGET_COLUMN not in dataset.column_names:
        return None
    values = dataset[BUDGET_COLUMN]
    budgets = []
    for row in rows:
        v = values[row]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= max_new_tokens:
            raise DatasetError(f"{name}: row {row}, column {BUDGET_COLUMN!r}: {v!r} is not a whole number from 1 to "
                               f"max_new_tokens = {max_new_tokens}")
        budgets.append(v)
    return budgets
