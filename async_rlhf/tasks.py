"""Task set-up shared by every recipe: which policy, prompts and reward a run uses.

`--task builtin` (default) is the shipped miniature of the paper's TL;DR setup (prepared into a cache on first
use), `--task toy` a seconds-scale smoke task, `--task hub` any hub model / dataset / reward model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from async_rlhf.config import ConfigError


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


def setup_task(script: ScriptArguments, config):
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


def save_and_evaluate(trainer, evaluate, output_dir: str) -> dict | None:
    """The end of every recipe: save the policy with its tokenizer, then (rank 0) the task's gold evaluation."""
    import json

    trainer.save_model(output_dir)
    if evaluate is None or not trainer.accelerator.is_main_process:
        return None
    results = evaluate(output_dir)
    print("final evaluation:", json.dumps(results, indent=2), flush=True)
    with open(os.path.join(output_dir, "eval_results.json"), "w") as f:
        json.dump(results, f, indent=2)
    return results


def resume_argument(config) -> str | bool | None:
    """`--resume_from_checkpoint PATH`, or `true` / `last` for the newest complete checkpoint in output_dir."""
    value = config.resume_from_checkpoint
    if isinstance(value, str) and value.lower() in ("true", "last", "last-checkpoint"):
        return True
    return value
