"""The sorting task: a verifiable task with completions of tens of tokens, where off-policy training can bite.

The built-in task's completions are about 5 tokens long, so a sample's log-ratio between two policies stays small
and every staleness setting trains alike there (evals/results/long_ablation). Here a prompt lists `k` digits
(`k` uniform in `MIN_DIGITS`..`MAX_DIGITS`) and the answer is the same digits in ascending order, then a period:

    SORT: 7 3 9 1 4 4 0 =
     0 1 3 4 4 7 9.

so a completion is k + 1 tokens plus EOS (9 to 33), and per-token ratios compound over tens of tokens.

Roles, as in the built-in task (`data/builtin_task.py`):
- the **gold reward** (`gold_reward`) is exact and programmatic: the fraction of positions holding the right digit
  (over the longer of answer and completion), plus 1 for an exact answer that stops cleanly (its only period
  last, not cut at the token limit); 0 to 2;
- the **references** (`reference` column) are the exact answers (gold reward 2): the win-rate against them is
  half the exact-match rate, so `evaluate_policy`'s `gold_reward` is the figure to read;
- the **SFT demonstrations** (`completion` column) are careless: most carry one or two slips (two neighbours
  swapped, a digit dropped or written twice), so the SFT policy sorts roughly and rarely exactly, and RL with the
  gold reward has tens of tokens per completion to fix.

There is no proxy reward model (`PROXY_REWARD_MODEL`): runs train on the gold reward, which is what a verifiable
task offers. Deterministic given `seed`; bump `TASK_VERSION` when the generator or the reward changes (the cached
SFT policy, `tasks/build_sorting.py`, is keyed by it).
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from async_rlhf.data.builtin_task import _text

TASK_VERSION = 1
NAME = "sorting"  # cache directories: <cache root>/sorting-v<TASK_VERSION>
PROXY_REWARD_MODEL = False  # trained on the gold reward

DIGITS: tuple[str, ...] = tuple("0123456789")
VOCABULARY: tuple[str, ...] = DIGITS + ("SORT", "=")  # each one token (with its leading space)
MIN_DIGITS, MAX_DIGITS = 8, 32
MAX_NEW_TOKENS = MAX_DIGITS + 4  # the longest answer, its period and EOS, and a little room to ramble
PROMPT_TEMPLATE = "SORT: {digits} ="
DEFAULT_SIZES = {"train": 8192, "validation": 256, "test": 512}
SLIP_RATE = 0.75  # fraction of demonstrations with at least one slip (half of those have a second)


def sample_digits(rng: random.Random) -> list[str]:
    return [rng.choice(DIGITS) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]


def answer(digits: list[str]) -> str:
    return " " + " ".join(sorted(digits)) + "."


def careless_answer(digits: list[str], rng: random.Random) -> str:
    """The sorted digits with up to two slips: two neighbours swapped, a digit dropped, or one written twice."""
    out = sorted(digits)
    slips = 0 if rng.random() >= SLIP_RATE else 1 + (rng.random() < 0.5)
    for _ in range(slips):
        kind = rng.choice(("swap", "drop", "repeat"))
        steps = [i for i in range(len(out) - 1) if out[i] != out[i + 1]]  # a swap of equal digits changes nothing
        if kind == "swap" and steps:
            i = rng.choice(steps)
            out[i], out[i + 1] = out[i + 1], out[i]
        elif kind == "drop" and len(out) > 1:
            del out[rng.randrange(len(out))]
        else:
            i = rng.randrange(len(out))
            out.insert(i, out[i])
    return " " + " ".join(out) + "."


def make_split(num_rows: int, seed: int, split: str) -> Dataset:
    """One split: `prompt`, `completion` (a careless demonstration) and `reference` (the exact answer)."""
    rng = random.Random(f"sorting-{seed}-{split}")
    demonstration_rng = random.Random(f"sorting-{seed}-{split}-demonstration")
    rows: dict[str, list] = {"prompt": [], "completion": [], "reference": []}
    for _ in range(num_rows):
        digits = sample_digits(rng)
        rows["prompt"].append(PROMPT_TEMPLATE.format(digits=" ".join(digits)))
        rows["completion"].append(careless_answer(digits, demonstration_rng))
        rows["reference"].append(answer(digits))
    return Dataset.from_dict(rows)


def make_splits(seed: int = 0, conversational: bool = False, sizes: dict[str, int] | None = None) -> DatasetDict:
    """Train / validation / test splits; a split's rows depend only on `seed` and its name. Plain text only
    (`conversational` is refused: the task has no chat format)."""
    if conversational:
        raise ValueError("the sorting task has no conversational format")
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    return DatasetDict({split: make_split(n, seed, split) for split, n in sizes.items()})


def prompt_digits(prompt: str) -> list[str]:
    body = prompt.split("SORT:", 1)[-1].rsplit("=", 1)[0]
    return body.split()


def score(digits: list[str], completion: str, truncated: bool = False) -> float:
    """Gold score of one completion for the prompt's `digits`. See `gold_reward`."""
    target = sorted(digits)
    text = completion.strip()
    ends_clean = text.endswith(".") and text.count(".") == 1 and not truncated
    written = text.replace(".", " ").split()
    right = sum(a == b for a, b in zip(written, target))
    return right / max(len(target), len(written)) + float(ends_clean and written == target)


def gold_reward(prompts: list, completions: list, truncated: list[bool] | None = None, **kwargs) -> list[float]:
    """The gold reward, with TRL's reward-function signature: per completion, the fraction of positions that hold
    the right digit (over the longer of the answer and the completion: a dropped or extra digit shifts the rest)
    plus 1 for the exact answer ending with its only period and not cut at the token limit. 0 to 2."""
    truncated = truncated or [False] * len(completions)
    return [score(prompt_digits(_text(p)), _text(c), t) for p, c, t in zip(prompts, completions, truncated)]
