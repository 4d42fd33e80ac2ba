"""A seconds-scale task for smoke runs and tests: random short prompts, a programmatic learnable reward.

The reward counts how many of the first characters of a completion are the letter `a` and adds a bonus for
ending (EOS) early, so even a randomly initialised char-level policy has signal to climb within a few steps.
"""

from __future__ import annotations

import random

from datasets import Dataset


def toy_prompts(n: int = 64, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    words = ["post", "cat", "sun", "tree", "river", "note", "code", "moon"]
    return Dataset.from_dict({"prompt": [" ".join(rng.choices(words, k=rng.randint(2, 5))) + ":" for _ in range(n)]})


def letter_a_reward(prompts, completions, completion_ids=None, **kwargs) -> list[float]:
    """Fraction of the completion's first 8 characters that are 'a' (0..1); deterministic and learnable."""
    return [sum(ch == "a" for ch in c[:8]) / 8.0 for c in completions]
