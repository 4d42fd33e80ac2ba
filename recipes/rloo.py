"""Asynchronous RLOO (k samples per prompt, leave-one-out baseline, KL in the reward).

    accelerate launch recipes/rloo.py                                  # built-in task (prepared on first use)
    accelerate launch recipes/rloo.py --max_staleness 0 --output_dir outputs/rloo_sync
    python recipes/rloo.py --task toy --max_steps 8 --output_dir /tmp/rloo  # a seconds-scale smoke run

Launched and configured exactly like recipes/online_dpo.py (same task flags, same asynchronous fields).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python recipes/rloo.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_rlhf.config import AsyncRLOOConfig
from async_rlhf.tasks import ScriptArguments, run_recipe  # noqa: F401  (the sweep reads the flags from these)


def main(argv: list[str]):
    return run_recipe("rloo", AsyncRLOOConfig, "AsyncRLOOTrainer", argv)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main(sys.argv[1:])
