"""Bad input fails early, with a message naming the problem, and leaves an existing output_dir untouched.

"Early" means before any model loads: the model path below does not exist, so a check that only ran after the
model load would surface as a different error (OSError from `from_pretrained`). Where a tokenizer is needed it
is passed in, built in code. Every test starts from an output_dir holding a finished checkpoint and a metrics
file, and checks afterwards that no byte of it changed.

Sections, by what is checked: config values, trainer arguments, the tokenizer, the dataset, each prompt.
"""

from __future__ import annotations

import hashlib
import logging
import os

import pytest
import torch
from datasets import Dataset

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer, AsyncRLOOConfig
from async_rlhf.config.cli import parse_args
from async_rlhf.errors import ConfigError
from async_rlhf.data.tiny_model import char_tokenizer
from async_rlhf.errors import DatasetError

MISSING_MODEL = "/nonexistent/model"


def reward(prompts, completions, **kw):
    return [0.0] * len(completions)


def _tree(root) -> dict[str, tuple[int, int, str]]:
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            path = os.path.join(d, name)
            st = os.stat(path)
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns,
                                                hashlib.sha256(open(path, "rb").read()).hexdigest())
    return out


@pytest.fixture
def output_dir(tmp_path):
    """An output_dir from an earlier run; asserts at the end of the test that nothing in it changed."""
    out = tmp_path / "out"
    ckpt = out / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"weights from an earlier run")
    (ckpt / "trainer_state.json").write_text('{"global_step": 4}')
    (ckpt / "async_rlhf_complete.json").write_text('{"format": 1, "version": 4}')
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.69}\n')
    before = _tree(out)
    yield str(out)
    assert _tree(out) == before, "bad input changed what was already saved in output_dir"


@pytest.fixture
def trainer(output_dir, make_config):
    """`trainer(dataset=None, tokenizer=None, **config)`: an online DPO trainer on MISSING_MODEL writing to
    output_dir; `dataset` defaults to two good prompts."""

    def build(dataset=None, tokenizer=None, **config):
        dataset = Dataset.from_dict({"prompt": ["hello", "world"]}) if dataset is None else dataset
        args = make_config(output_dir=output_dir, **config)
        return AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=args, train_dataset=dataset,
                                     processing_class=tokenizer)

    return build


# ---- config values -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, kw, message", [
    (AsyncOnlineDPOConfig, {"generator_backend": "tgi"}, r"generator_backend: 'tgi' is not one of \('auto', "
                                                        r"'vllm', 'transformers'\)"),
    (AsyncOnlineDPOConfig, {"reward_failure": "ignore"}, r"reward_failure: 'ignore' is not one of \('raise', "
                                                         r"'skip'\)"),
    (AsyncOnlineDPOConfig, {"loss_type": "hinge"}, "loss_type: 'hinge' is not 'sigmoid' or 'ipo'"),
    (AsyncOnlineDPOConfig, {"top_p": 1.5}, r"top_p: must be in \(0, 1\], got 1.5"),
    (AsyncOnlineDPOConfig, {"max_staleness": -2}, "max_staleness: must be an integer >= 0, got -2"),
    (AsyncOnlineDPOConfig, {"sync_every": 3, "max_staleness": 0}, "sync_every: .* Use sync_every <= "
                                                                  "max_staleness \\+ 1"),
    (AsyncOnlineDPOConfig, {"save_total_limit": 1}, "save_total_limit: 1 would delete .* use >= 2 or None"),
    (AsyncRLOOConfig, {"off_policy_correction": "vtrace"}, r"off_policy_correction: 'vtrace' is not one of "
                                                           r"\('none', 'tis', 'decoupled'\)"),
])
def test_out_of_range_values_name_the_field_and_the_valid_values(output_dir, make_config, cls, kw, message):
    with pytest.raises(ConfigError, match=message):
        make_config(cls, output_dir=output_dir, **kw)


def test_out_of_range_value_from_the_command_line(output_dir):
    with pytest.raises(ConfigError, match=r"generator_backend: 'sglang' is not one of \('auto', 'vllm', 'transformers'\)"):
        parse_args((AsyncOnlineDPOConfig,), ["--output_dir", output_dir, "--generator_backend", "sglang"])


@pytest.mark.parametrize("device", ["cpu:x", "npu:0", "cuda", "cuda:-1", "gpu0"])
def test_generator_device_of_unknown_form_lists_the_valid_forms(output_dir, make_config, device):
    with pytest.raises(ConfigError, match=rf"generator_devices: '{device}' is not 'cpu' or 'cuda:<index>'"):
        make_config(output_dir=output_dir, generator_devices=[device])


def test_generator_gpu_that_does_not_exist_is_refused_before_the_model_loads(trainer):
    missing = f"cuda:{torch.cuda.device_count() + 6}"  # "cuda:7" on a machine with one GPU, "cuda:6" on a CPU one
    with pytest.raises(ConfigError, match=rf"generator_devices: \['{missing}'\] not on this machine.*valid devices "
                                          r"here: \['cpu'"):
        trainer(tokenizer=char_tokenizer(), generator_devices=["cpu", missing])


# ---- trainer arguments -------------------------------------------------------------------------------------------
def test_missing_dataset_or_reward_is_named(output_dir, make_config):
    args = make_config(output_dir=output_dir)
    with pytest.raises(DatasetError, match="train_dataset"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=args)
    with pytest.raises(ConfigError, match="reward_funcs"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, args=args, train_dataset=Dataset.from_dict({"prompt": ["x"]}))


def test_a_peft_config_that_is_not_one_is_refused_before_the_model_loads(output_dir, make_config):
    pytest.importorskip("peft")
    with pytest.raises(TypeError, match="peft_config: must be a peft.PeftConfig instance .* got object"):
        AsyncOnlineDPOTrainer(MISSING_MODEL, reward_funcs=reward, args=make_config(output_dir=output_dir),
                              peft_config=object(), train_dataset=Dataset.from_dict({"prompt": ["x"]}))


# ---- tokenizer -------------------------------------------------------------------------------------------------
def test_tokenizer_without_eos_or_pad_is_refused_before_the_model_loads(trainer):
    tok = char_tokenizer()
    tok.eos_token, tok.pad_token = None, None
    with pytest.raises(ConfigError, match="processing_class: the tokenizer has no eos_token"):
        trainer(tokenizer=tok)


def test_tokenizer_without_pad_pads_with_eos(trainer):
    tok = char_tokenizer()
    tok.pad_token = None
    with pytest.raises(OSError, match="nonexistent"):  # got past every tokenizer check, to the model load
        trainer(tokenizer=tok)
    assert tok.pad_token == tok.eos_token == "<eos>"


# ---- the dataset ---------------------------------------------------------------------------------------------------
def test_dataset_without_a_prompt_column_names_its_columns(trainer):
    pairs = Dataset.from_dict({"chosen": ["a"], "rejected": ["b"]})  # an offline preference dataset
    with pytest.raises(DatasetError, match=r"no 'prompt' column \(columns: \['chosen', 'rejected'\]\)"):
        trainer(dataset=pairs)


def test_empty_dataset(trainer):
    with pytest.raises(DatasetError, match="empty"):
        trainer(dataset=Dataset.from_dict({"prompt": []}))


# ---- each prompt ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, message", [
    (["fine", ""], "row 1: empty prompt"),
    (["ok", "  "], "row 1: empty prompt"),
    ([[{"role": "user", "content": "hi"}], []], "row 1: empty conversation"),
    ([[{"role": "user", "content": "hi"}], [{"text": "no role"}]], r"row 1: 'prompt' must be text or a list"),
    (["fine", None], "row 1: 'prompt' must be text or a list of chat messages"),
    ([3, 4], "row 0: 'prompt' must be text or a list of chat messages .* got int"),
])
def test_bad_prompts_name_the_row(trainer, prompts, message):
    with pytest.raises(DatasetError, match=message):
        trainer(dataset=Dataset.from_dict({"prompt": prompts}))


def test_huge_prompts_are_skipped_and_all_huge_is_refused_before_the_model_loads(trainer, caplog):
    huge = "x" * 200_000
    with caplog.at_level(logging.WARNING, logger="async_rlhf.data.prompts"):
        with pytest.raises(OSError, match="nonexistent"):  # one huge prompt: skipped, the run goes on to load
            trainer(dataset=Dataset.from_dict({"prompt": ["short", huge, "fine"]}), tokenizer=char_tokenizer(),
                    max_length=64, max_new_tokens=16)
    assert "skipped 1 prompt(s) longer than 48 tokens (rows [1])" in caplog.text
    with pytest.raises(DatasetError, match="every prompt is longer than max_length - max_new_tokens = 48 tokens"):
        trainer(dataset=Dataset.from_dict({"prompt": [huge, huge]}), tokenizer=char_tokenizer(), max_length=64,
                max_new_tokens=16)
