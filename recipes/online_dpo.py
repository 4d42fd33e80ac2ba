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

from async_rlhf.cli import parse_args
from async_rlhf.config import AsyncOnlineDPOConfig
from async_rlhf.tasks import (ScriptArguments, add_periodic_evaluation, resume_argument, save_and_evaluate,
                              setup_task, task_defaults)


def main(argv: list[str]) -> None:
    script, config = parse_args((ScriptArguments, AsyncOnlineDPOConfig), argv, task_defaults('online_dpo'))
    from async_rlhf import AsyncOnlineDPOTrainer

    with config.main_process_first(desc="task set-up"):  # rank 0 builds caches and models; the others then read
        model, reward, train_dataset, evaluate = setup_task(script, config)
    trainer = AsyncOnlineDPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train_dataset)
    add_periodic_evaluation(trainer, evaluate, script.gold_eval_steps)
    trainer.train(resume_from_checkpoint=resume_argument(config))
    save_and_evaluate(trainer, evaluate, config.output_dir)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main(sys.argv[1:])
