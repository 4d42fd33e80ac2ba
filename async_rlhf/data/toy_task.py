"""A seconds-scale task for smoke runs and tests: random short prompts and a dense, learnable reward.

The reward is the fraction of a completion's characters that are lowercase letters. A randomly initialised
char-level policy starts near 0.25 (26 of ~100 symbols), so two samples almost never tie and there is signal
from the first step; a learner that works pushes it towards 1 within a few dozen steps.
"""

from __future__ import annotations

import random
import string

from datasets import Dataset


def toy_prompts(n: int = 64, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    words = ["post", "cat", "sun", "tree", "river", "note", "code", "moon"]
    return Dataset.from_dict({"prompt": [" ".join(rng.choices(words, k=rng.randint(2, 5))) + ":" for _ in range(n)]})


def lowercase_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Fraction of the completion's characters that are lowercase ASCII letters (0 for an empty completion)."""
    return [sum(ch in string.ascii_lowercase for ch in c) / len(c) if c else 0.0 for c in completions]
