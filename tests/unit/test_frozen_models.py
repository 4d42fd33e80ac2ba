"""The inference-only DeepSpeed config that the reference and reward models run under (`learner/frozen_models.py`)."""

from __future__ import annotations

import copy

from async_rlhf.learner.frozen_models import _frozen_engine_config

TRAIN = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
    "scheduler": {"type": "WarmupLR"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": 1000,
    },
}


def test_zero3_keeps_partitioning_and_drops_what_needs_an_optimizer():
    before = copy.deepcopy(TRAIN)
    frozen = _frozen_engine_config(TRAIN, hidden_size=64)
    assert TRAIN == before  # the training config is not touched
    assert "optimizer" not in frozen and "scheduler" not in frozen
    zero = frozen["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" not in zero and zero["offload_param"] == {"device": "cpu"}
    # "auto" sizes resolved from the hidden size (64 * 64 = 4096), explicit ones kept
    assert zero["reduce_bucket_size"] == 4096
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096)
    assert zero["stage3_param_persistence_threshold"] == 1000
    assert frozen["bf16"] == {"enabled": True}  # same precision as the policy


def test_zero1_and_2_become_stage_0_replicas():
    for stage in (1, 2):
        train = {**copy.deepcopy(TRAIN), "zero_optimization": {"stage": stage, "overlap_comm": True,
                                                               "offload_optimizer": {"device": "cpu"}}}
        frozen = _frozen_engine_config(train, hidden_size=64)
        assert frozen["zero_optimization"] == {"stage": 0}
        assert "optimizer" not in frozen and frozen["bf16"] == {"enabled": True}
