"""Asynchronous online DPO.

    accelerate launch recipes/online_dpo.py                                   # built-in task (prepared on first use)
    accelerate launch recipes/online_dpo.py --config launch/configs/online_dpo_builtin.yaml --max_staleness 0
    python recipes/online_dpo.py --task toy --max_steps 8 --output_dir /tmp/dpo  # a seconds-scale smoke run
    accelerate launch recipes/online_dpo.py --task hub --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \
        --dataset_name trl-lib/tldr --reward_model_path <rm> --generator_devices cuda:1

Set-up (task, models, data, reward), train on the asynchronous pipeline, save, evaluate (built-in task).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # `python recipes/online_dpo.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_rlhf.cli import parse_args
from async_rlhf.config import AsyncOnlineDPOConfig, ConfigError


@dataclass
class ScriptArguments:
    task: str = field(default="builtin", metadata={"help": "'builtin' (the shipped miniature TL;DR task), 'toy' "
                                                          "(random model, letter reward: seconds) or 'hub'."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Policy (default: the task's SFT model)."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset or local file (task 'hub')."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset config name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    reward: str = field(default="proxy", metadata={"help": "builtin task: 'proxy' (trained reward model, as the "
                                                           "paper) or 'gold' (the programmatic gold reward)."})
    eval_prompts: int = field(default=128, metadata={"help": "Held-out prompts for the final gold evaluation "
                                                             "(builtin task; 0 skips it)."})


def setup_task(script: ScriptArguments, config: AsyncOnlineDPOConfig):
    """Returns (model, reward_funcs, train_dataset, eval_fn or None)."""
    if script.task == "toy":
        from async_rlhf.models import save_tiny_model
        from async_rlhf.toy_task import lowercase_reward, toy_prompts

        path = script.model_name_or_path or os.path.join(config.output_dir, "init_model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            save_tiny_model(path)
        return path, lowercase_reward, toy_prompts(256, config.seed), None
    if script.task == "builtin":
        from async_rlhf.data.builtin_task import gold_reward, make_splits
        from async_rlhf.data.prepare import prepare_builtin

        paths = prepare_builtin(seed=0)
        splits = make_splits(seed=0)
        reward = gold_reward if script.reward == "gold" else (config.reward_model_path or paths["reward_model"])
        model = script.model_name_or_path or paths["sft_model"]

        def evaluate(model_dir):
            from async_rlhf.evaluation import evaluate_policy

            return evaluate_policy(model_dir, paths["sft_model"], num_prompts=script.eval_prompts, seed=0)

        return model, reward, splits["train"], (evaluate if script.eval_prompts > 0 else None)
    if script.task == "hub":
        from datasets import load_dataset

        if not (script.model_name_or_path and script.dataset_name and config.reward_model_path):
            raise ConfigError("task 'hub' needs --model_name_or_path, --dataset_name and --reward_model_path")
        data = load_dataset(script.dataset_name, script.dataset_config, split=script.dataset_train_split)
        return script.model_name_or_path, config.reward_model_path, data, None
    raise ConfigError(f"task: {script.task!r} is not one of 'builtin', 'toy', 'hub'")


def main(argv: list[str]) -> None:
    script, config = parse_args((ScriptArguments, AsyncOnlineDPOConfig), argv)
    from async_rlhf import AsyncOnlineDPOTrainer

    with config.main_process_first(desc="task set-up"):  # rank 0 builds caches and models; the others then read
        model, reward, train_dataset, evaluate = setup_task(script, config)
    trainer = AsyncOnlineDPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train_dataset)
    trainer.train()
    trainer.save_model(config.output_dir)
    if evaluate is not None and trainer.accelerator.is_main_process:
        results = evaluate(config.output_dir)
        print("final evaluation:", json.dumps(results, indent=2))
        with open(os.path.join(config.output_dir, "eval_results.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main(sys.argv[1:])
