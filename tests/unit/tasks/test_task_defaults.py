"""Every documented task runs with no flag but `--task`: each recipe brings the task's own defaults
(`launch/configs/<recipe>_<task>.yaml`), and they fit the task's model; a context the model cannot hold is refused
by the trainer's constructor, naming both numbers, before any model loads or generator starts."""

from __future__ import annotations

import pytest
from datasets import Dataset

from async_rlhf.config import algorithms as c
from async_rlhf.config.cli import parse_args
from async_rlhf.errors import ConfigError
from async_rlhf.tasks.setup import ScriptArguments, task_defaults

RECIPES = {"online_dpo": c.AsyncOnlineDPOConfig, "rloo": c.AsyncRLOOConfig, "ppo": c.AsyncPPOConfig,
           "best_of_n": c.AsyncBestOfNConfig}


def _positions(task: str) -> int:
    """max_position_embeddings of the model the task trains (read from the code that builds it)."""
    if task == "toy":
        from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama

        return tiny_llama(char_tokenizer()).config.max_position_embeddings
    if task == "sorting":
        from async_rlhf.tasks.build_sorting import MAX_POSITIONS

        return MAX_POSITIONS
    if task == "longtail":
        from async_rlhf.data.longtail_task import SFT_MAX_POSITIONS

        return SFT_MAX_POSITIONS
    from async_rlhf.tasks.build_builtin import SFT_MAX_POSITIONS

    return SFT_MAX_POSITIONS


@pytest.mark.parametrize("task", ["builtin", "longtail", "sorting", "toy"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_task_alone_gives_settings_its_model_holds(recipe, task):
    script, config = parse_args((ScriptArguments, RECIPES[recipe]), ["--task", task], task_defaults(recipe))
    assert script.task == task
    assert task in task_defaults(recipe), f"recipes/{recipe}.py has no launch/configs/{recipe}_{task}.yaml"
    positions = _positions(task)
    assert config.max_length <= positions, (recipe, task, config.max_length, positions)
    assert (config.vllm_max_model_len or config.max_length) <= positions


def _trainer(model, **overrides):
    from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer

    args = AsyncOnlineDPOConfig(output_dir="/tmp/async_rlhf-unused", **overrides)
    return AsyncOnlineDPOTrainer(model, reward_funcs=lambda prompts, completions, **kw: [0.0] * len(completions),
                                 args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]}))


def test_max_length_beyond_the_models_positions_is_refused_naming_both(tiny_model_dir, monkeypatch):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the context length was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    with pytest.raises(ConfigError, match=r"max_length: 512 .*max_position_embeddings 256"):
        _trainer(tiny_model_dir, max_length=512)
    with pytest.raises(ConfigError, match=r"vllm_max_model_len: 300 .*max_position_embeddings 256"):
        _trainer(tiny_model_dir, max_length=128, vllm_max_model_len=300)
