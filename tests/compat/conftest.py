"""Local stand-ins for the hub fixtures of TRL's own online-DPO tests, and the two implementations under test.

TRL's tests load `trl-internal-testing/tiny-Qwen2ForCausalLM-2.5` (policy), `tiny-LlamaForCausalLM-3.2` (as a
sequence-classification reward model) and the `trl-internal-testing/zen` prompts. Here: tiny Llamas with the
character tokenizer (`async_rlhf/data/tiny_model.py`), built once per session, and a few zen lines as prompts, in
TRL's two prompt-only formats. The policy's head size is 16, which vLLM's CPU attention does not support, so our
trainer's default `generator_backend="auto"` takes the transformers generator (seconds to start) on CPU; the vLLM case
uses `vllm_policy` (head size 32), as TRL's uses a bigger model there.

`impl` is parametrized over TRL's `OnlineDPOConfig`/`OnlineDPOTrainer` (the control) and ours, imported under TRL's
names, as a user switching one import would. TRL is imported only when its case runs: importing
`trl.experimental.online_dpo` imports vLLM (10-30 s).
"""

from __future__ import annotations

import types

import pytest
import torch
from datasets import Dataset

ZEN = ["Beautiful is better than", "Explicit is better than", "Simple is better than", "Complex is better than",
       "Flat is better than", "Sparse is better than", "Readability", "Special cases aren't special enough",
       "Although practicality beats", "Errors should never", "Unless explicitly", "In the face of ambiguity,",
       "There should be one", "Although that way may not", "Now is better than", "Although never is often"]
POLICY = dict(hidden_size=32, num_heads=2, max_position_embeddings=640)  # head size 16; room for max_length 512


def _import(name: str):
    if name == "trl":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
    else:
        from async_rlhf import AsyncOnlineDPOConfig as OnlineDPOConfig
        from async_rlhf import AsyncOnlineDPOTrainer as OnlineDPOTrainer
    return types.SimpleNamespace(name=name, OnlineDPOConfig=OnlineDPOConfig, OnlineDPOTrainer=OnlineDPOTrainer)


@pytest.fixture(params=["trl", "async_rlhf"])
def impl(request):
    return _import(request.param)  # a case may pass `impl` itself (indirect) to mark one of the two


@pytest.fixture(scope="session")
def compat_dirs(tmp_path_factory):
    """{"policy": dir, "reward": dir}: a tiny policy and a tiny sequence-classification reward model, saved."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from async_rlhf.data.tiny_model import char_tokenizer, save_tiny_model

    root = tmp_path_factory.mktemp("compat")
    policy = save_tiny_model(str(root / "policy"), **POLICY)
    tok = char_tokenizer()
    torch.manual_seed(1)
    reward = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=640, num_labels=1, pad_token_id=tok.pad_token_id))
    reward.save_pretrained(root / "reward")
    tok.save_pretrained(root / "reward")
    vllm_policy = save_tiny_model(str(root / "vllm_policy"), hidden_size=64, num_heads=2, max_position_embeddings=640)
    return {"policy": policy, "vllm_policy": vllm_policy, "reward": str(root / "reward")}


@pytest.fixture
def models(compat_dirs):
    """What TRL's `setup_method` builds: model (float32), ref_model, tokenizer, reward model and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(compat_dirs["policy"])
    tokenizer.pad_token = tokenizer.eos_token
    reward_tokenizer = AutoTokenizer.from_pretrained(compat_dirs["reward"])
    reward_tokenizer.pad_token = reward_tokenizer.eos_token
    return types.SimpleNamespace(
        model_id=compat_dirs["policy"],
        model=AutoModelForCausalLM.from_pretrained(compat_dirs["policy"], dtype="float32"),
        ref_model=AutoModelForCausalLM.from_pretrained(compat_dirs["policy"]),
        tokenizer=tokenizer,
        reward_model=AutoModelForSequenceClassification.from_pretrained(compat_dirs["reward"], num_labels=1),
        reward_tokenizer=reward_tokenizer)


@pytest.fixture
def zen_prompts():
    """`zen_prompts(config_name)`: the prompts of TRL's `zen` dataset config `config_name`, built locally."""
    return _zen_prompts


def _zen_prompts(config_name: str) -> Dataset:
    """TRL's `trl-internal-testing/zen` prompt-only configs, locally: text prompts or one-message conversations."""
    if config_name == "standard_prompt_only":
        return Dataset.from_dict({"prompt": ZEN})
    if config_name == "conversational_prompt_only":
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What comes after '{z}'?"}] for z in ZEN]})
    raise ValueError(config_name)


@pytest.fixture(autouse=True, scope="module")
def _generators_forked(forked_generators):
    """Our trainers' generators start as the recipes start them (tests/conftest.py::forked_generators)."""
