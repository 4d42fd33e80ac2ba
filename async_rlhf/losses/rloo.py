"""RLOO: REINFORCE with a leave-one-out baseline over the k completions of each prompt.

Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human Feedback
in LLMs" (arXiv:2402.14740, Sec. 3), after Kool et al. 2019. Each prompt gets k ≥ 2 completions; the baseline of
completion i is the mean reward of the other k − 1, so the advantage needs no value network.

The KL penalty to the reference model is folded into the sequence reward (`kl_shaped_rewards`), and the update is
the clipped PPO loss of `ppo.py` with the sequence advantage repeated on every completion token (`rloo_loss`);
this is where its staleness corrections ("tis", "decoupled", "masked") come from. Note the ratio is per token, as in
`ppo_policy_loss`; TRL's former RLOOTrainer clipped the ratio of whole-sequence probabilities instead.

Shapes: B = sequences, T = completion tokens, k = completions per prompt. Masks are bool or float [B, T].
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_rlhf.losses.off_policy import check_same_shape
from async_rlhf.losses.ppo import ppo_policy_loss


def rloo_advantages(rewards: Tensor) -> Tensor:
    """Leave-one-out advantages A_i = r_i − (1/(k−1))·Σ_{j≠i} r_j  (= k/(k−1)·(r_i − mean_j r_j)).

    Args:
        rewards: [P, k] sequence rewards, one row per prompt, one column per completion (k ≥ 2). NaN marks an
            unscorable completion (TRL 1.16's RLOOTrainer): the baseline averages the scorable siblings only, and
            an unscorable completion, or the only scorable one of its group, gets advantage NaN (the caller zeroes
            it, as TRL does, after any normalisation).

    Returns: [P, k] detached advantages; each row of finite rewards sums to 0. To feed `rloo_loss`, flatten with
    `.reshape(-1)`, which matches a batch where each prompt's k completions are contiguous.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, k], got shape {tuple(rewards.shape)}")
    k = rewards.shape[1]
    if k < 2:
        raise ValueError(f"RLOO needs k >= 2 completions per prompt, got k={k}")
    rewards = rewards.detach()
    scorable = (~torch.isnan(rewards)).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(rewards, dim=1, keepdim=True) - rewards) / (scorable - 1)
    return rewards - baseline


def kl_shaped_rewards(scores: Tensor, logps: Tensor, ref_logps: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Sequence reward with the KL penalty: score − kl_coef · Σ_t mask_t·(log π(y_t) − log π_ref(y_t)).

    The sum is the usual single-sample estimate of KL(π ‖ π_ref) for the sampled completion (the "k1"
    estimator), as in TRL's RLOOTrainer. The result is detached: it is a reward, not a differentiable penalty.

    Args:
        scores: [B] reward-model (or reward-function) scores.
        logps: [B, T] log-probs of the sampled tokens under the policy that sampled them.
        ref_logps: [B, T] log-probs under the frozen reference model.
        mask: [B, T] 1 on completion tokens; padding is ignored whatever it holds.
        kl_coef: β ≥ 0.

    Returns: [B] detached rewards.
    """
    check_same_shape(logps=logps, ref_logps=ref_logps, mask=mask)
    if scores.dim() != 1 or scores.shape[0] != logps.shape[0]:
        raise ValueError(f"scores must be [B] with B={logps.shape[0]}, got shape {tuple(scores.shape)}")
    with torch.no_grad():
        fmask = mask.to(logps.dtype)
        log_ratio = torch.where(fmask != 0, logps - ref_logps, 0.0)
        kl = (log_ratio * fmask).sum(dim=-1)
        return scores.detach().to(logps.dtype) - kl_coef * kl


def rloo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    behaviour_logps: Tensor | None = None,
    off_policy: str = "none",
    is_cap: float | None = 2.0,
    is_floor: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`ppo.ppo_policy_loss` with one advantage per sequence, repeated over its tokens.

    Args:
        advantages: [B] sequence advantages, e.g. `rloo_advantages(rewards).reshape(-1)`.
        logps, old_logps, mask, behaviour_logps: [B, T]; everything else as in `ppo_policy_loss`, whose
            docstring defines the "none" / "tis" / "decoupled" / "masked" modes.

    Returns (loss, metrics) from `ppo_policy_loss`.
    """
    if advantages.dim() != 1 or advantages.shape[0] != logps.shape[0]:
        raise ValueError(
            f"advantages must be [B] with B={logps.shape[0]} (one per sequence), got shape {tuple(advantages.shape)}"
        )
    token_advantages = advantages.detach().to(logps.dtype)[:, None].expand_as(logps)
    return ppo_policy_loss(
        logps,
        old_logps,
        token_advantages,
        mask,
        clip_eps=clip_eps,
        behaviour_logps=behaviour_logps,
        off_policy=off_policy,
        is_cap=is_cap,
        is_floor=is_floor,
    )
