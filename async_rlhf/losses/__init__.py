"""Losses as pure functions: tensors in, `(loss, metrics)` out, metrics detached and without a stage prefix.

One file per family: `dpo.py` (DPO, IPO), `ppo.py` (GAE, clipped policy and value losses with off-policy
corrections), `rloo.py` (leave-one-out advantages and the RLOO loss), `grpo.py`
(group-relative advantages and TRL's GRPO loss types), `sft.py` (Best-of-N NLL), and
`off_policy.py` (importance weights between learner and behaviour policy; the shared masking helpers).
"""

from async_rlhf.losses.dpo import DPO_LOSS_TYPES, dpo_loss
from async_rlhf.losses.grpo import grpo_advantages, grpo_loss
from async_rlhf.losses.off_policy import (
                                         OFF_POLICY_MODES,
                                         importance_ess,
                                         log_ratio_stats,
                                         masked_importance_weights,
                                         masked_mean,
                                         off_policy_weights,
                                         truncated_importance_weights,
)
from async_rlhf.losses.ppo import gae_advantages, ppo_policy_loss, ppo_value_loss, whiten
from async_rlhf.losses.rloo import kl_shaped_rewards, rloo_advantages, rloo_loss
from async_rlhf.losses.sft import best_of_n_nll

__all__ = [
    "DPO_LOSS_TYPES",
    "OFF_POLICY_MODES",
    "best_of_n_nll",
    "dpo_loss",
    "gae_advantages",
    "grpo_advantages",
    "grpo_loss",
    "importance_ess",
    "kl_shaped_rewards",
    "log_ratio_stats",
    "masked_importance_weights",
    "masked_mean",
    "off_policy_weights",
    "ppo_policy_loss",
    "ppo_value_loss",
    "rloo_advantages",
    "rloo_loss",
    "truncated_importance_weights",
    "whiten",
]
