"""Which prompts each optimizer step trains on: a pure function of (seed, step).

Every epoch is a seeded permutation of the prompt indices; step b takes the b-th block of `prompts_per_step`
prompts of the concatenated epochs (an epoch's incomplete last block is skipped, as a `drop_last` loader
would). Because the mapping has no state, a resumed run or a regenerated batch gets exactly the same prompts,
and no prompt is used twice or skipped within an epoch.
"""

from __future__ import annotations

import math

import torch


def total_steps(args, num_prompts: int) -> int:
    """Optimizer steps of a run: `max_steps` when set, else `num_train_epochs` epochs of whole steps."""
    if args.max_steps > 0:
        return args.max_steps
    return math.ceil(args.num_train_epochs * (num_prompts // args.prompts_per_step))


class PromptStream:
    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int):
        if num_prompts < prompts_per_step:
            raise ValueError(
                f"train_dataset: {num_prompts} prompt(s) is fewer than one step needs ({prompts_per_step} = "
                f"per_device_train_batch_size x processes x gradient_accumulation_steps)")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.steps_per_epoch = num_prompts // prompts_per_step
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.num_prompts, generator=g).tolist()}
        return self._perms[epoch]

    def prompts_for_step(self, step: int) -> list[int]:
        epoch, block = divmod(step, self.steps_per_epoch)
        start = block * self.prompts_per_step
        return self._perm(epoch)[start:start + self.prompts_per_step]
