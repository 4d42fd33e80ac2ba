"""Preparing the long-tail task (`data/longtail_task.py`) once: the built-in task's three steps (`tasks/build_builtin.py`:
SFT policy, gold-labelled pairs, proxy reward model) with settings for its longer, heavy-tailed summaries, cached in
`<cache root>/longtail-v<TASK_VERSION>` with the same guarantees (atomic, locked, rebuilt on a new version).

What differs from the built-in task's build, and why:
- the policy's context is `longtail_task.SFT_MAX_POSITIONS` (640: the longest post and summary);
- SFT batches group examples of similar length (`length_grouped`): sequences run from 15 to 500 tokens, and a
  random batch would pad to its longest;
- preference pairs are sampled up to 256 new tokens with prompts in order of length (`sort_prompts`: a sampling
  batch decodes until its longest sample ends, and a post's length predicts its summary's), and there are half
  as many (2048, and 256 held out), which keeps the build within minutes on two cores.
"""

from __future__ import annotations

from async_rlhf.data import longtail_task
from async_rlhf.tasks.build_builtin import RewardModelSettings, SFTSettings, prepare_task


def sft_settings(seed: int = 0) -> SFTSettings:
    return SFTSettings(seed=seed, num_examples=8192, steps=1200, batch_size=32, learning_rate=2e-3, length_grouped=True)


def reward_model_settings(seed: int = 0) -> RewardModelSettings:
    return RewardModelSettings(seed=seed, num_pairs=2048, num_eval_pairs=256,
                               max_new_tokens=longtail_task.MAX_NEW_TOKENS, batch_size=32, learning_rate=3e-4,
                               sort_prompts=True)


def prepare_longtail(cache_dir: str | None = None, seed: int = 0, sft: SFTSettings | None = None,
                     reward: RewardModelSettings | None = None) -> dict:
    """Make sure the long-tail task's tokenizer, SFT policy and proxy reward model exist; return their paths
    ({"cache_dir", "tokenizer", "sft_model", "reward_model", "manifest"}). `sft` / `reward` override the settings
    above (tests build a reduced variant into a cache directory of their own)."""
    return prepare_task(longtail_task, cache_dir, seed, sft or sft_settings(seed),
                        reward or reward_model_settings(seed), max_positions=longtail_task.SFT_MAX_POSITIONS,
                        what="the long-tail task", minutes="10-15")
