"""A seconds-scale task for smoke runs and tests: random short prompts and a dense, learnable reward.

The reward is the fraction of a completion's characters that are lowercase letters. A randomly initialised
char-level policy starts near 0.25 (26 of ~100 symbols), so two samples almost never tie and there is signal
from the first step; a learner that works pushes it towards 1 within a few dozen steps.
"""

from __future__ import annotations

import math
import random
import string

from datasets import Dataset


def toy_prompts(n: int = 64, seed: int = 0, lengths: tuple[float, float, int] | None = None) -> Dataset:
    """`n` prompts. `lengths` = (mean, coefficient of variation, cap): each prompt also gets its own completion budget
    (a `max_new_tokens` column), drawn from a lognormal with that mean and spread and clipped to [1, cap], so that
    response lengths are heavy-tailed and follow the prompt (a random policy rarely ends before its budget)."""
    rng = random.Random(seed)
    words = ["post", "cat", "sun", "tree", "river", "note", "code", "moon"]
    columns = {"prompt": [" ".join(rng.choices(words, k=rng.randint(2, 5))) + ":" for _ in range(n)]}
    if lengths is not None:
        mean, cv, cap = lengths
        sigma = math.sqrt(math.log(1 + cv * cv))  # lognormal: cv^2 = exp(sigma^2) - 1, mean = exp(mu + sigma^2 / 2)
        mu = math.log(mean) - sigma * sigma / 2
        columns["max_new_tokens"] = [min(cap, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]
    return Dataset.from_dict(columns)


def lowercase_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Fraction of the completion's characters that are lowercase ASCII letters (0 for an empty completion)."""
    return [sum(ch in string.ascii_lowercase for ch in c) / len(c) if c else 0.0 for c in completions]
