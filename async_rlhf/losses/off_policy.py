"""How far stale samples have drifted: importance weights between the learner and the behaviour policy.

In asynchronous RLHF a completion is sampled by a generator holding weights that are a few optimizer steps
old (the *behaviour* policy μ, whose per-token log-probs travel with the rollout), but trained on by the
learner's current weights π. The per-token log-ratio log π − log μ is the whole cost of staleness: when it is
0 everywhere, training is on-policy. `log_ratio_stats` summarises it for logging (with `importance_ess`, the
effective sample size of the weights); `off_policy_weights` turns it into the per-token weights that
`ppo.ppo_policy_loss` and `grpo.grpo_loss` multiply into their loss, one of the corrections the field converged on:

    "tis"        token-level truncated IS, min(w_t, cap)                  (`truncated_importance_weights`)
    "decoupled"  w_t, dropped (0) above cap                               (Hilton et al.'s weight, AReaL's cap)
    "masked"     w_t inside [floor, cap], dropped outside: masked IS with two-sided bounds, IcePop-style
                                                                          (`masked_importance_weights`)

Truncation keeps every token (biased, bounded variance); masking drops the tokens whose policies disagree most
(unbiased on the rest, less data). With one optimizer step per batch the learner's weights before the update are
the current forward pass (detached), so each mode is a re-weighted policy gradient on the sampled tokens.

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
        is_ess: `importance_ess` of the raw weights w_t: 1 on-policy, towards 1/n as a few tokens dominate.
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
            "is_ess": importance_ess(weights, fmask),
        }


def importance_ess(weights: Tensor, mask: Tensor) -> Tensor:
    """Normalised effective sample size of importance weights over the masked tokens, a detached scalar in (0, 1]:

        ESS / n = (Σ_t w_t)² / (n · Σ_t w_t²)          (Kong 1992; n = number of masked tokens)

    1 when every weight is equal (on-policy: all 1), 1/n when one token carries all the weight. Dropped tokens
    (weight 0) count in n, so masking lowers it too. An empty mask or all-zero weights give 0.

    Args:
        weights: [B, T] non-negative weights (any grad is ignored).
        mask: [B, T] bool or float, 1 on the tokens that count.
    """
    check_same_shape(weights=weights, mask=mask)
    with torch.no_grad():
        fmask = mask.to(weights.dtype)
        w = torch.where(fmask != 0, weights.detach(), torch.zeros((), dtype=weights.dtype, device=weights.device))
        n = fmask.sum()
        total, squares = (w * fmask).sum(), (w * w * fmask).sum()
        if n.item() == 0 or squares.item() == 0:
            return torch.zeros((), dtype=weights.dtype, device=weights.device)
        return total * total / (n * squares)


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


def masked_importance_weights(
    learner_logps: Tensor, behaviour_logps: Tensor, floor: float, cap: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Token-level masked importance weights (detached): w_t = exp(log π_t − log μ_t) if floor ≤ w_t ≤ cap, else 0.

    The two-sided bound is IcePop's (the Ling team's Ring-1T report, 2025: tokens whose weight falls outside [α, β]
    leave the gradient); floor = 0 is the one-sided masked IS ("MIS") that followed truncated IS in the 2025 work on
    generator/learner mismatch. Unlike truncation
    (`truncated_importance_weights`), a token whose policies disagree too much, in either direction, is dropped
    rather than kept at the bound: no biased gradient from it, one token less of data.

    Args:
        learner_logps: [B, T] log-probs under the learner (or proximal) policy.
        behaviour_logps: [B, T] log-probs under the behaviour policy that sampled the tokens.
        floor: lower bound, 0 ≤ floor < 1 (0: one-sided). cap: upper bound, > 1.
        mask: optional [B, T]; when given, `masked_frac` counts only masked tokens.

    Returns:
        weights: [B, T] detached, exactly 1.0 wherever learner_logps == behaviour_logps.
        masked_frac: detached scalar, the fraction of (masked) tokens whose weight fell outside [floor, cap].
    """
    if not 0 <= floor < 1 or not cap > 1:
        raise ValueError(f"need 0 <= floor < 1 < cap, got floor={floor}, cap={cap}")
    check_same_shape(learner_logps=learner_logps, behaviour_logps=behaviour_logps)
    if mask is None:
        mask = torch.ones_like(learner_logps)
    check_same_shape(learner_logps=learner_logps, mask=mask)
    with torch.no_grad():
        raw = torch.exp(learner_logps.detach() - behaviour_logps.detach())
        outside = (raw < floor) | (raw > cap)
        weights = torch.where(outside, torch.zeros((), dtype=raw.dtype, device=raw.device), raw)
        masked_frac = masked_mean(outside.to(raw.dtype), mask)
    return weights, masked_frac


OFF_POLICY_MODES = ("none", "tis", "decoupled", "masked")


def off_policy_weights(
    old_logps: Tensor, behaviour_logps: Tensor, mask: Tensor, off_policy: str, is_cap: float | None,
    is_floor: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token weight of a loss term under `off_policy` ("tis" | "decoupled" | "masked"; see the module
    docstring), from the proximal log-probs `old_logps` and the behaviour log-probs, both [B, T]; padding
    (mask 0) gets weight 1 whatever it holds. is_cap: the upper bound ("decoupled": None keeps every weight);
    is_floor: the lower bound of "masked".

    Returns (weights [B, T] detached, metrics): is_weight_mean (mean applied weight), is_capped_frac (fraction of
    tokens truncated / dropped), is_ess (`importance_ess` of the applied weights).
    """
    if off_policy not in OFF_POLICY_MODES[1:]:
        raise ValueError(f"off_policy_weights: unknown off_policy {off_policy!r}; valid: "
                         f"{', '.join(OFF_POLICY_MODES[1:])}")
    fmask = mask.to(old_logps.dtype)
    old_logps = old_logps.detach()
    behaviour_logps = torch.where(fmask != 0, behaviour_logps.detach(), old_logps)  # padding: weight exactly 1
    if off_policy == "tis":
        weights, capped_frac = truncated_importance_weights(old_logps, behaviour_logps, is_cap, fmask)
    elif off_policy == "masked":
        weights, capped_frac = masked_importance_weights(old_logps, behaviour_logps, is_floor, is_cap, fmask)
    else:
        with torch.no_grad():
            weights = torch.exp(old_logps - behaviour_logps)
            if is_cap is None:
                capped_frac = torch.zeros((), dtype=weights.dtype, device=weights.device)
            else:
                over = weights > is_cap
                capped_frac = masked_mean(over.to(weights.dtype), fmask)
                weights = torch.where(over, 0.0, weights)
    return weights, {"is_weight_mean": masked_mean(weights, fmask).detach(), "is_capped_frac": capped_frac.detach(),
                     "is_ess": importance_ess(weights, fmask)}
