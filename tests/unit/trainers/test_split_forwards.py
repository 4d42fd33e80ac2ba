"""`split_forwards`: length buckets and shared prefixes by default on CPU learners, not on GPU learners (on an H100 the
split step of a 203M-parameter policy took 1.93x the padded one's time at 2,560 padded tokens and 0.89x-1.12x of it
from 15,744 to 34,560, docs/performance.md), forced either way by the user, refused under DeepSpeed."""

from types import SimpleNamespace

import pytest
import torch

from async_rlhf.config.checks import check_learner_combinations
from async_rlhf.errors import ConfigError
from async_rlhf.trainers.base import AsyncTrainerBase


def resolved(split_forwards, device: str, deepspeed: bool = False) -> bool:
    trainer = SimpleNamespace(args=SimpleNamespace(split_forwards=split_forwards), is_deepspeed_enabled=deepspeed,
                              accelerator=SimpleNamespace(device=torch.device(device)))
    return AsyncTrainerBase.splits_forwards(trainer)


@pytest.mark.parametrize("setting, device, deepspeed, expected", [
    (None, "cpu", False, True),
    (None, "cuda", False, False),
    (True, "cuda", False, True),
    (False, "cpu", False, False),
    (False, "cuda", False, False),
    (None, "cpu", True, False),
])
def test_split_forwards_resolves_per_device(setting, device, deepspeed, expected):
    assert resolved(setting, device, deepspeed) == expected


def test_split_forwards_true_is_refused_under_deepspeed():
    with pytest.raises(ConfigError, match=r"split_forwards=True cannot go with DeepSpeed: .*one forward per backward"):
        check_learner_combinations(SimpleNamespace(split_forwards=True, score_while_generating=None,
                                                   reference_while_generating=False), deepspeed=True, lora=False)
    check_learner_combinations(SimpleNamespace(split_forwards=None, score_while_generating=None,
                                               reference_while_generating=False), deepspeed=True, lora=False)
