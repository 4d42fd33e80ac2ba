"""How far stale samples have drifted: importance weights between the learner and the behaviour policy.

In asynchronous RLHF a completion is sampled by a generator holding weights that are a few optimizer steps
old (the *behaviour* policy μ, whose per-token log-probs travel with the rollout), but trained on by the
learner's current weights π. The per-token log-ratio log π − log μ is the whole cost of staleness: when it is
0 everywhere, training is on-policy. `log_ratio_stats` summarises it for logging; `truncated_importance_weights`
turns it into the capped weights that `ppo.ppo_policy_loss(off_policy="tis")` multiplies into its loss.

This module is the bottom layer of `losses/`: `masked_mean` and `check_same_shape` live here and the other
loss files import them, so that no loss file imports a sibling that imports it back.

Shapes: B = batch (sequences), T = completion tokens. Masks are bool or float [B, T], 1 on tokens that count
(completion tokens), 0 on padding; padding may hold any value, even inf or nan, in the other tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_same_shape(**tensors: Tensor) -> None:
    """Raise ValueError unless every tensor has the same shape, naming each argument and its shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise ValueError(f"shape mismatch: expected equal shapes, got {listed}")


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over the positions where `mask` is nonzero, weighted by `mask`; a scalar.

    x, mask: the same shape. Padding values never leak in (not even nan/inf): they are replaced by 0 before the
    product. An all-zero mask gives 0, not nan, so an empty micro-batch contributes no gradient.
    """
    mask = mask.to(x.dtype)
    x = torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return (x * mask).sum() / mask.sum().clamp_min(1e-8)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max of a non-negative `x` over masked positions (0 for an empty mask)."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device)).max()


def log_ratio_stats(learner_logps: Tensor, behaviour_logps: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Drift between the learner's and the behaviour policy's log-probs of the sampled tokens.

    Args:
        learner_logps: [B, T] log π(y_t | x, y_<t) under the learner's weights (any grad is ignored).
        behaviour_logps: [B, T] log μ(y_t | ...) under the generator weights that sampled y.
        mask: [B, T] bool or float, 1 on completion tokens.

    Returns detached scalars, with ρ_t = log π − log μ and w_t = exp(ρ_t) = π/μ:
        log_ratio_mean: mean ρ_t over masked tokens.
        log_ratio_abs_mean / log_ratio_abs_max: mean / max |ρ_t|: the headline "how stale is this batch".
        seq_log_ratio_abs_mean: mean over sequences of |Σ_t ρ_t|, the sequence-level log importance weight.
        is_weight_mean / is_weight_max: mean / max of w_t. E_μ[w] = 1, so a mean far from 1 means drift.
        kl: mean of (w_t − 1) − log w_t, the k3 estimator of KL(μ ‖ π) from tokens sampled by μ
            (Schulman 2020, http://joschu.net/blog/kl-approx.html); ≥ 0, exactly 0 when π == μ.
    """
    check_same_shape(learner_logps=learner_logps, behaviour_logps=behaviour_logps, mask=mask)
    with torch.no_grad():
        fmask = mask.to(learner_logps.dtype)
        keep = fmask != 0
        log_ratio = torch.where(keep, learner_logps.detach() - behaviour_logps.detach(), 0.0)
        weights = torch.exp(log_ratio)
        seq_log_ratio = (log_ratio * fmask).sum(dim=-1)
        return {
            "log_ratio_mean": masked_mean(log_ratio, fmask),
            "log_ratio_abs_mean": masked_mean(log_ratio.abs(), fmask),
            "log_ratio_abs_max": _masked_max(log_ratio.abs(), fmask),
            "seq_log_ratio_abs_mean": seq_log_ratio.abs().mean(),
            "is_weight_mean": masked_mean(weights, fmask),
            "is_weight_max": _masked_max(weights, fmask),
            "kl": masked_mean((weights - 1.0) - log_ratio, fmask),
        }


def truncated_importance_weights(
    learner_logps: Tensor, behaviour_logps: Tensor, cap: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Token-level truncated importance weights w_t = min(exp(log π_t − log μ_t), cap), detached.

    The truncation trades a little bias for bounded variance (the "truncated IS" of IMPALA, Espeholt et al. 2018,
    arXiv:1802.01561, and of Yao et al. 2025's fix for generator/learner mismatch). The weights are detached: they
    re-weight the learner's gradient, they never receive one. Weights below the cap are kept as they are.

    Args:
        learner_logps: [B, T] log-probs under the learner (or proximal) policy.
        behaviour_logps: [B, T] log-probs under the behaviour policy that sampled the tokens.
        cap: the truncation level, > 0 (usually ≥ 1; 2.0 is a common choice).
        mask: optional [B, T]; when given, `clipped_frac` counts only masked tokens. The weights themselves are
            returned for every position (padding weights are meaningless; the losses mask them out).

    Returns:
        weights: [B, T] detached, exactly 1.0 wherever learner_logps == behaviour_logps.
        clipped_frac: detached scalar, the fraction of (masked) tokens whose raw weight exceeded `cap`.
    """
    if not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    check_same_shape(learner_logps=learner_logps, behaviour_logps=behaviour_logps)
    if mask is None:
        mask = torch.ones_like(learner_logps)
    check_same_shape(learner_logps=learner_logps, mask=mask)
    with torch.no_grad():
        raw = torch.exp(learner_logps.detach() - behaviour_logps.detach())
        weights = raw.clamp(max=cap)
        clipped_frac = masked_mean((raw > cap).to(raw.dtype), mask)
    return weights, clipped_frac
