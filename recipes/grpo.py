"""Asynchronous GRPO (k samples per prompt, group-relative advantages, TRL 1.16's loss types).

    python recipes/grpo.py --output_dir outputs/grpo         # built-in task (prepared on first use)
    python recipes/grpo.py --max_staleness 0 --output_dir outputs/grpo_sync
    python recipes/grpo.py --task toy --max_steps 8 --output_dir /tmp/grpo  # a seconds-scale smoke run
    python recipes/grpo.py --task hub --model_name_or_path <policy> --dataset_name openai/gsm8k --hub_reward gsm8k

The last one trains on GSM8k with the verifiable exact-match reward on the '#### <number>' answer
(`data/loaders.gsm8k_reward`); `--dataset_data_files train.jsonl` reads a local copy instead of the hub.

Launched and configured exactly like recipes/online_dpo.py (same task flags, same asynchronous fields); as in
TRL's GRPOConfig, `--per_device_train_batch_size` counts completions (num_generations per prompt), not prompts.
GRPO's own fields (loss_type, scale_rewards, epsilon_high, ...) are TRL's GRPOConfig names
(async_rlhf/config/algorithms.py).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # `python recipes/grpo.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # a run: the generators' imports start now, beside the learner's (generation/pool/prewarm.py)
    from async_rlhf.generation.pool.prewarm import prewarm_generators

    prewarm_generators()

from async_rlhf.config.algorithms import AsyncGRPOConfig
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
from async_rlhf.trainers.grpo import AsyncGRPOTrainer


def main(argv: list[str]) -> AsyncGRPOTrainer:
    script, config = parse_args((ScriptArguments, AsyncGRPOConfig), argv, task_defaults("grpo"))
    with config.main_process_first(desc="task set-up"):  # rank 0 builds caches and models; the others then read
        task = setup_task(script, config)
    trainer = AsyncGRPOTrainer(model=task.model, reward_funcs=task.reward, args=config,
                               train_dataset=task.train_dataset, peft_config=get_peft_config(script),
                               environment_factory=task.environment_factory)
    add_periodic_evaluation(trainer, task.evaluate, script.gold_eval_steps)
    trainer.train(resume_from_checkpoint=resume_argument(config))
    save_and_evaluate(trainer, task.evaluate, config.output_dir)
    trainer.accelerator.end_training()  # the process group goes before the interpreter tears down its threads
    return trainer


if __name__ == "__main__":
    run_recipe(main, sys.argv[1:])
