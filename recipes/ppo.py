"""Asynchronous PPO with a learned critic and GAE (TRL's former PPOv2 defaults).

    python recipes/ppo.py                                  # built-in task (prepared on first use)
    python recipes/ppo.py --max_staleness 0 --output_dir outputs/ppo_sync
    python recipes/ppo.py --task toy --max_steps 8 --output_dir /tmp/ppo  # a seconds-scale smoke run

Launched and configured exactly like recipes/online_dpo.py (same task flags, same asynchronous fields).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python recipes/ppo.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # a run: the generators' imports start now, beside the learner's (generation/pool/prewarm.py)
    from async_rlhf.generation.pool.prewarm import prewarm_generators

    prewarm_generators()

from async_rlhf.config.algorithms import AsyncPPOConfig
from async_rlhf.config.cli import parse_args, run_recipe
from async_rlhf.learner.peft_policy import get_peft_config
from async_rlhf.tasks.setup import (
    ScriptArguments,
    add_periodic_evaluation,
    resume_argument,
    save_and_evaluate,
    setup_task,
    task_defaults,
)
from async_rlhf.trainers.ppo import AsyncPPOTrainer


def main(argv: list[str]) -> AsyncPPOTrainer:
    script, config = parse_args((ScriptArguments, AsyncPPOConfig), argv, task_defaults("ppo"))
    with config.main_process_first(desc="task set-up"):  # rank 0 builds caches and models; the others then read
        task = setup_task(script, config)
    trainer = AsyncPPOTrainer(model=task.model, reward_funcs=task.reward, args=config,
                              train_dataset=task.train_dataset, peft_config=get_peft_config(script))
    add_periodic_evaluation(trainer, task.evaluate, script.gold_eval_steps)
    trainer.train(resume_from_checkpoint=resume_argument(config))
    save_and_evaluate(trainer, task.evaluate, config.output_dir)
    trainer.accelerator.end_training()  # the process group goes before the interpreter tears down its threads
    return trainer


if __name__ == "__main__":
    run_recipe(main, sys.argv[1:])
