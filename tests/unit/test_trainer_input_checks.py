"""Bad input fails before any model loads: the model path below does not exist, so reaching the load would
raise a different error."""

import pytest
from datasets import Dataset

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.config import ConfigError
from async_rlhf.data.prompts import DatasetError

MISSING_MODEL = "/nonexistent/model"


def reward(prompts, completions, **kw):
    return [0.0] * len(completions)


@pytest.fixture
def args(tmp_path):
    return AsyncOnlineDPOConfig(output_dir=str(tmp_path))


def test_dataset_without_prompt_column_names_its_columns(args):
    ds = Dataset.from_dict({"text": ["a"], "label": [1]})
    with pytest.raises(DatasetError, match=r"no 'prompt' column \(columns: \['text', 'label'\]\)"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=args, train_dataset=ds)


def test_empty_dataset(args):
    with pytest.raises(DatasetError, match="empty"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": []}))


def test_missing_dataset_and_reward(args):
    with pytest.raises(DatasetError, match="train_dataset"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=args)
    with pytest.raises(ConfigError, match="reward_funcs"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]}))


def test_peft_is_refused_clearly(args):
    with pytest.raises(NotImplementedError, match="peft_config"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=args, peft_config=object(),
                              train_dataset=Dataset.from_dict({"prompt": ["x"]}))


@pytest.mark.parametrize("prompts, message", [
    (["ok", "  "], "row 1: empty prompt"),
    ([[{"role": "user", "content": "hi"}], [{"text": "no role"}]], r"row 1: 'prompt' must be text or a list"),
])
def test_bad_prompts_name_the_row(args, prompts, message):
    with pytest.raises(DatasetError, match=message):
        AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": prompts}))


def test_too_long_prompts_are_skipped_but_not_all(args, tiny_model_dir):
    args.max_length, args.max_new_tokens = 20, 10
    with pytest.raises(DatasetError, match="every prompt is longer than"):
        AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["x" * 50]}))
