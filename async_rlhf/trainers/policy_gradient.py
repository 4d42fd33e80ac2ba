"""What the policy-gradient learners (RLOO, PPO) share: the per-token log-prob terms of a micro-batch and the
choice of the ratio's denominator under each off-policy correction.

For a stale sample three policies matter: the behaviour policy μ that the generator sampled from (its log-probs
travel with the rollout), the proximal policy π_prox (the learner's weights before this update: with one
optimizer step per batch it is the current forward pass, detached), and the policy π being trained.
- "none": the PPO ratio is π/μ, clipped: plain PPO on whatever data arrived.
- "tis", "decoupled": the ratio is π/π_prox, clipped, and each token is weighted by π_prox/μ (capped / dropped
  above `is_cap`); see `losses/ppo.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from async_rlhf.logprobs import behaviour_logps, completion_batch, token_logps
from async_rlhf.losses.off_policy import log_ratio_stats
from async_rlhf.types import Completion, ScoredGroup


@dataclass
class PolicyTerms:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L]
    logps: torch.Tensor  # [B, L-1] under the policy, at the sampling temperature, with gradient
    ref_logps: torch.Tensor  # [B, L-1] under the frozen reference, same temperature
    behaviour: torch.Tensor  # [B, L-1] the generator's log-probs (μ)
    mask: torch.Tensor  # [B, L-1] 1 on completion tokens (of valid rows only)
    scores: torch.Tensor  # [B] reward per completion, 0 where invalid
    valid: torch.Tensor  # [B] bool: the completion's group has only finite rewards
    completions: list[Completion]


def policy_terms(trainer, model, groups: list[ScoredGroup]) -> PolicyTerms:
    a = trainer.args
    ids, attn, cmask, comps = completion_batch(groups, trainer.processing_class.pad_token_id, a.max_length,
                                               trainer.accelerator.device)
    logps, mask, _ = token_logps(model, ids, attn, cmask, temperature=a.temperature)
    with torch.no_grad():
        ref, _, _ = token_logps(trainer.ref_model, ids, attn, cmask, temperature=a.temperature)
    mu = behaviour_logps(comps, mask)
    group_ok = [all(math.isfinite(r) for r in g.rewards) for g in groups]
    valid = torch.tensor([ok for g, ok in zip(groups, group_ok) for _ in g.completions], device=mask.device)
    scores = torch.tensor([r if ok else 0.0 for g, ok in zip(groups, group_ok) for r in g.rewards],
                          device=mask.device)
    mask = mask * valid[:, None].to(mask.dtype)
    return PolicyTerms(ids, attn, cmask, logps, ref, mu, mask, scores, valid, comps)


def ratio_denominator(t: PolicyTerms, correction: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(old_logps, behaviour_logps) for `ppo_policy_loss` under `correction`."""
    if correction == "none":
        return t.behaviour, None
    return t.logps.detach(), t.behaviour


def common_metrics(t: PolicyTerms, shaped: torch.Tensor, beta: float) -> dict[str, float]:
    """TRL-named objective metrics plus behaviour-vs-learner drift (what staleness costs)."""
    rows = t.valid
    kl = ((t.logps.detach() - t.ref_logps) * t.mask).sum(-1)
    out = {
        "objective/scores": t.scores[rows].mean().item() if rows.any() else 0.0,
        "objective/kl": kl[rows].mean().item() if rows.any() else 0.0,
        "objective/non_score_reward": -beta * (kl[rows].mean().item() if rows.any() else 0.0),
        "objective/rlhf_reward": shaped[rows].mean().item() if rows.any() else 0.0,
        "learner/valid_fraction": rows.float().mean().item(),
    }
    drift = log_ratio_stats(t.logps.detach(), t.behaviour, t.mask)
    for k in ("log_ratio_mean", "log_ratio_abs_max", "is_weight_mean", "is_weight_max", "kl"):
        out[f"off_policy/{k}"] = float(drift[k])
    return out
