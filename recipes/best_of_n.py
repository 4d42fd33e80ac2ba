"""Asynchronous Best-of-N SFT (the paper's Best-of-2: N = num_generations = 2).

    accelerate launch recipes/best_of_n.py                                  # built-in task (prepared on first use)
    accelerate launch recipes/best_of_n.py --max_staleness 0 --output_dir outputs/best_of_n_sync
    python recipes/best_of_n.py --task toy --max_steps 8 --output_dir /tmp/best_of_n  # a seconds-scale smoke run

Launched and configured exactly like recipes/online_dpo.py (same task flags, same asynchronous fields).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python recipes/best_of_n.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_rlhf.config import AsyncBestOfNConfig
from async_rlhf.tasks import ScriptArguments, run_recipe  # noqa: F401  (the sweep reads the flags from these)


def main(argv: list[str]):
    return run_recipe("best_of_n", AsyncBestOfNConfig, "AsyncBestOfNTrainer", argv)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main(sys.argv[1:])
