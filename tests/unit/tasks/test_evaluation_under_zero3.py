"""Rank 0's evaluation after (or during) a ZeRO-3 run loads its models whole: transformers partitions every
`from_pretrained` with DeepSpeed's `zero.Init` while a ZeRO-3 config is registered, a collective the other ranks never
join (the built-in task's final evaluation failed on it after a 2-rank ZeRO-3 run)."""

from __future__ import annotations

from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from async_rlhf.tasks.evaluation import whole_models


def test_models_load_whole_inside_and_the_run_keeps_its_zero3_config(tiny_model_dir):
    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_batch_size": 1})  # as a ZeRO-3 run has
    assert is_deepspeed_zero3_enabled()
    with whole_models():
        assert not is_deepspeed_zero3_enabled()
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert all(p.numel() > 0 and not hasattr(p, "ds_id") for p in model.parameters())  # not partitioned
    assert is_deepspeed_zero3_enabled() and config.is_zero3()


def test_without_a_deepspeed_run_nothing_changes():
    with whole_models():
        assert not is_deepspeed_zero3_enabled()
    assert not is_deepspeed_zero3_enabled()
