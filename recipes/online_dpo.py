"""Asynchronous online DPO.

    accelerate launch recipes/online_dpo.py                                   # built-in task (prepared on first use)
    accelerate launch recipes/online_dpo.py --config launch/configs/online_dpo_builtin.yaml --max_staleness 0
    python recipes/online_dpo.py --task toy --max_steps 8 --output_dir /tmp/dpo  # a seconds-scale smoke run
    accelerate launch recipes/online_dpo.py --task hub --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name trl-lib/tldr --reward_model_path <rm> --generator_devices cuda:1

Set-up (task, models, data, reward), train on the asynchronous pipeline, save, evaluate (built-in task).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python recipes/online_dpo.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_rlhf.config import AsyncOnlineDPOConfig
from async_rlhf.tasks import ScriptArguments, run_recipe  # noqa: F401  (the sweep reads the flags from these)


def main(argv: list[str]):
    return run_recipe("online_dpo", AsyncOnlineDPOConfig, "AsyncOnlineDPOTrainer", argv)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main(sys.argv[1:])
