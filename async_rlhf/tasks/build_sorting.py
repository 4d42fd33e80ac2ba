"""Preparing the sorting task (`data/sorting_task.py`) once: its tokenizer and SFT policy (no proxy reward model: it
trains on the gold reward), cached in `<cache root>/sorting-v<TASK_VERSION>[-size]` with the built-in task's
guarantees (atomic, locked, rebuilt on a new version; `tasks/build_builtin.py`).

`size` picks the policy: the sizes in `SIZES` are the policy-size axis of the staleness study
(evals/results/sorting_staleness); the default is the built-in task's 1.2M-parameter Llama shape.
"""

from __future__ import annotations

from async_rlhf.data import sorting_task
from async_rlhf.tasks.build_builtin import (
    RewardModelSettings,
    SFTSettings,
    prepare_task,
)
from async_rlhf.tasks.cache import default_cache_dir

# policy size -> (hidden size, layers, heads)
SIZES = {"small": (64, 2, 2), "default": (128, 4, 4), "large": (256, 6, 8)}
MAX_POSITIONS = 128  # a prompt of 32 digits (35 tokens) and its answer (34)
# what the first build takes on an idle 2-core CPU, said before it starts (large: 1.3 s a step, measured)
BUILD_MINUTES = {"small": "about 5", "default": "8-10", "large": "20-25"}


def sft_settings(size: str = "default", seed: int = 0) -> SFTSettings:
    hidden, layers, heads = SIZES[size]
    return SFTSettings(seed=seed, num_examples=8192, steps=1000, batch_size=64, learning_rate=2e-3,
                       hidden_size=hidden, num_layers=layers, num_heads=heads)


def prepare_sorting(size: str = "default", cache_dir: str | None = None, seed: int = 0,
                    sft: SFTSettings | None = None) -> dict:
    """Make sure the sorting task's tokenizer and SFT policy of `size` exist; return their paths ({"cache_dir",
    "tokenizer", "sft_model", "manifest", ...}). `sft` overrides the settings (tests build a reduced one)."""
    if size not in SIZES:
        raise ValueError(f"sorting policy size {size!r} is not one of {', '.join(SIZES)}")
    if cache_dir is None and size != "default":
        cache_dir = default_cache_dir(seed, sorting_task) + f"-{size}"
    # no reward model is trained: its settings only give the SFT evaluation's token budget
    evaluation = RewardModelSettings(seed=seed, max_new_tokens=sorting_task.MAX_NEW_TOKENS)
    return prepare_task(sorting_task, cache_dir, seed, sft or sft_settings(size, seed), evaluation,
                        max_positions=MAX_POSITIONS, what=f"the sorting task ({size} policy)",
                        minutes=BUILD_MINUTES[size])
