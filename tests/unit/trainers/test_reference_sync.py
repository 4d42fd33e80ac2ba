"""TRL's `sync_ref_model` on the group learners (`trainers/policy_gradient.SyncReference`): the mix, with the
arithmetic written out, and when it runs."""

from __future__ import annotations

import types

import torch

from async_rlhf.trainers.policy_gradient import SyncReference, mix_into


def test_mix_into_is_alpha_policy_plus_one_minus_alpha_reference():
    ref, policy = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        ref.weight.fill_(1.0)
        policy.weight.fill_(3.0)
    mix_into(ref, policy, 0.25)
    assert ref.weight.item() == 0.25 * 3.0 + 0.75 * 1.0  # 1.5
    assert policy.weight.item() == 3.0  # the policy is read, never written


def test_the_sync_runs_every_ref_model_sync_steps():
    ref, policy = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        ref.weight.fill_(0.0)
        policy.weight.fill_(1.0)
    args = types.SimpleNamespace(ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    trainer = types.SimpleNamespace(args=args, ref_model=ref, model=policy, is_deepspeed_enabled=False,
                                    fuses_reference=lambda: False,
                                    accelerator=types.SimpleNamespace(unwrap_model=lambda m: m))
    sync = SyncReference(trainer)
    for step in (1, 2, 3, 4):
        sync.on_step_end(args, types.SimpleNamespace(global_step=step), None)
    assert ref.weight.item() == 0.75  # steps 2 and 4: 0 -> 0.5 -> 0.75
