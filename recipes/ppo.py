"""Asynchronous PPO with a learned critic and GAE (TRL's former PPOv2 defaults).

    accelerate launch recipes/ppo.py                                  # built-in task (prepared on first use)
    accelerate launch recipes/ppo.py --max_staleness 0 --output_dir outputs/ppo_sync
    python recipes/ppo.py --task toy --max_steps 8 --output_dir /tmp/ppo  # a seconds-scale smoke run

Launched and configured exactly like recipes/online_dpo.py (same task flags, same asynchronous fields).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python recipes/ppo.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_rlhf.config import AsyncPPOConfig
from async_rlhf.tasks import ScriptArguments, run_recipe  # noqa: F401  (the sweep reads the flags from these)


def main(argv: list[str]):
    return run_recipe("ppo", AsyncPPOConfig, "AsyncPPOTrainer", argv)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main(sys.argv[1:])
