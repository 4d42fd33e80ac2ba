"""PPO: generalized advantage estimation, the clipped policy loss with off-policy corrections, the value loss.

Three policies can appear in one asynchronous PPO step, and the `off_policy` argument of `ppo_policy_loss`
says which ones the loss uses:

    μ       behaviour policy: the generator weights that sampled the completion (`behaviour_logps`, carried
            by the rollout). With staleness k it is the learner as it was k optimizer steps ago.
    π_prox  proximal policy: the learner's weights at the start of this update, before any minibatch step
            (`old_logps` in the "tis" and "decoupled" modes; the caller recomputes them with a no-grad forward).
    π_θ     the learner being optimised (`logps`, the only input that carries gradient).

All losses here are token-level means over the masked tokens of the whole batch (as TRL's PPOTrainer does),
so a long completion weighs more than a short one.

Shapes: B = batch (sequences), T = completion tokens; masks are bool or float [B, T], 1 on completion tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_rlhf.losses.off_policy import OFF_POLICY_MODES, check_same_shape, masked_mean, off_policy_weights


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16).

        δ_t = r_t + γ·V_{t+1} − V_t           (V_{t+1} = 0 past the last completion token: the episode ends)
        A_t = δ_t + γλ·A_{t+1}                 returns_t = A_t + V_t

    Args:
        rewards: [B, T] per-token rewards (in RLHF usually −β·KL per token plus the score on the last token).
        values: [B, T] value-head predictions V(s_t); no gradient flows through the outputs.
        mask: [B, T] 1 on completion tokens. Completions must be right-padded (mask a prefix of ones per row);
            rewards and values on padding are ignored, whatever they hold.
        gamma: discount γ in [0, 1]. lam: GAE λ in [0, 1].

    Returns:
        advantages: [B, T] detached, 0 on padding. Not whitened: call `whiten` if you want that.
        returns: [B, T] detached value targets A_t + V_t, 0 on padding.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    with torch.no_grad():
        fmask = mask.to(values.dtype)
        keep = fmask != 0
        rewards = torch.where(keep, rewards.detach(), 0.0)
        values = torch.where(keep, values.detach(), 0.0)
        T = rewards.shape[-1]
        advantages = torch.zeros_like(values)
        last_gae = torch.zeros_like(values[..., 0])
        for t in reversed(range(T)):
            next_values = values[..., t + 1] if t + 1 < T else torch.zeros_like(last_gae)
            delta = rewards[..., t] + gamma * next_values - values[..., t]
            last_gae = (delta + gamma * lam * last_gae) * fmask[..., t]
            advantages[..., t] = last_gae
        returns = (advantages + values) * fmask
    return advantages, returns


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise `x` to zero mean and unit variance over the masked positions; padding is set to 0.

    (x − mean) / sqrt(var + eps), with the unbiased (Bessel-corrected) masked variance, as TRL's `masked_whiten`.
    shift_mean=False adds the mean back (only rescales). x, mask: [B, T] (any equal shapes).
    Raises ValueError when fewer than two positions are masked in (the variance is undefined); that check reads
    the count back to the host (one device sync per call, once per batch in practice).
    """
    check_same_shape(x=x, mask=mask)
    fmask = mask.to(x.dtype)
    count = fmask.sum()
    if count.item() < 2:
        raise ValueError(f"whiten needs at least 2 masked-in positions, got {count.item()}")
    mean = masked_mean(x, fmask)
    var = masked_mean((x - mean) ** 2, fmask) * count / (count - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(fmask != 0, out, 0.0)


def ppo_policy_loss(
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
    """Clipped PPO policy loss (Schulman et al. 2017, arXiv:1707.06347, eq. 7), with off-policy corrections.

    With r_t = exp(logps − old_logps) and the per-token clipped term
        ℓ_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − ε, 1 + ε))          (= −min(r·A, clip(r)·A) of eq. 7)
    the loss is masked_mean(w_t · ℓ_t), where the weight w_t depends on `off_policy`:

    "none":  w_t = 1. Standard PPO: `old_logps` is whatever the caller passes. Plain PPO on stale data passes
             the behaviour log-probs μ here, so the ratio both corrects for staleness and bounds the step.
             `behaviour_logps` must be None (pass μ as `old_logps` instead).
    "tis":   w_t = min(π_prox/μ, is_cap) = min(exp(old_logps − behaviour_logps), is_cap), detached: truncated
             importance sampling. `old_logps` is the proximal policy π_prox; `behaviour_logps` is μ.
             Weights above the cap are truncated to the cap (the token still trains, with weight `is_cap`).
             At one optimizer pass per batch π_prox is the policy being trained, so r_t = 1 and the clip never
             binds: the loss is then a truncated-IS-weighted policy gradient with no trust region.
    "decoupled": the decoupled PPO objective of Hilton et al. 2021 (arXiv:2110.00641, Sec. 3):
             L = E_μ[ (π_prox/μ) · min(r_t·A_t, clip(r_t, 1 − ε, 1 + ε)·A_t) ],  r_t = π_θ/π_prox,
             i.e. the ratio is clipped against the proximal policy (`old_logps`, the learner before this update)
             and the importance weight w_t = π_prox/μ (detached) corrects for the behaviour policy. Hilton's
             weight is untruncated; as a guard against exploding weights, tokens whose weight exceeds `is_cap`
             are dropped (w_t = 0, still counted in the mean's denominator, as AReaL's `behav_imp_weight_cap`).
             is_cap=None keeps every weight (exactly Hilton's objective).
    "masked": as "decoupled", but a token is dropped when its weight is outside [is_floor, is_cap] (masked IS with
             two-sided bounds, IcePop-style; `off_policy.masked_importance_weights`).

    When old_logps == behaviour_logps, "tis", "decoupled" and "masked" reduce exactly to "none" (all weights are 1).

    Args:
        logps: [B, T] log π_θ of the sampled tokens; carries the gradient.
        old_logps: [B, T] log-probs the ratio is taken against (detached inside).
        advantages: [B, T] per-token advantages (detached inside).
        mask: [B, T] 1 on completion tokens.
        clip_eps: ε, the ratio clip range.
        behaviour_logps: [B, T] log μ, required by "tis", "decoupled" and "masked".
        off_policy: "none" | "tis" | "decoupled" | "masked".
        is_cap: importance-weight cap for "tis" and "masked" (required) and "decoupled" (optional, None = no cap).
        is_floor: the lower bound of "masked" (0 ≤ is_floor < 1).

    Returns (loss, metrics); metrics are detached scalars:
        loss; clipfrac: fraction of tokens where the clipped term is the active one;
        approxkl: 0.5·mean((log π_θ − log π_old)²) (TRL's estimator); ratio_mean, ratio_max: of r_t;
        with a correction also is_weight_mean (mean applied w_t), is_capped_frac (fraction of tokens whose raw
        weight was out of bounds: truncated for "tis", dropped for "decoupled" / "masked") and is_ess (normalised
        effective sample size of the applied weights, `off_policy.importance_ess`).
    """
    if off_policy not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off_policy {off_policy!r}; valid: {', '.join(OFF_POLICY_MODES)}")
    check_same_shape(logps=logps, old_logps=old_logps, advantages=advantages, mask=mask)
    if off_policy == "none" and behaviour_logps is not None:
        raise ValueError(
            "behaviour_logps is only used by off_policy='tis' or 'decoupled'; for plain PPO on stale data "
            "pass the behaviour log-probs as old_logps"
        )
    if off_policy != "none":
        if behaviour_logps is None:
            raise ValueError(f"off_policy={off_policy!r} needs behaviour_logps")
        check_same_shape(logps=logps, behaviour_logps=behaviour_logps)
        if off_policy in ("tis", "masked") and is_cap is None:
            raise ValueError(f"off_policy={off_policy!r} needs a float is_cap")

    # Padding may hold anything (TRL pads log-probs with 1.0, others with 0 or nan): neutralise it up front so
    # that no inf/nan reaches a product whose backward would turn 0·inf into nan.
    fmask = mask.to(logps.dtype)
    keep = fmask != 0
    old_logps = old_logps.detach()
    advantages = torch.where(keep, advantages.detach(), 0.0)
    log_ratio = torch.where(keep, logps - old_logps, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.max(unclipped, clipped)

    metrics: dict[str, Tensor] = {}
    if off_policy != "none":
        weights, weight_metrics = off_policy_weights(old_logps, behaviour_logps, fmask, off_policy, is_cap, is_floor)
        per_token = per_token * weights
        metrics.update(weight_metrics)

    loss = masked_mean(per_token, fmask)
    with torch.no_grad():
        metrics["loss"] = loss.detach()
        metrics["clipfrac"] = masked_mean((clipped > unclipped).to(logps.dtype), fmask)
        metrics["approxkl"] = 0.5 * masked_mean(log_ratio.detach() ** 2, fmask)
        metrics["ratio_mean"] = masked_mean(ratio.detach(), fmask)
        metrics["ratio_max"] = torch.where(fmask != 0, ratio.detach(), 0.0).max()
    return loss, metrics


def ppo_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range_value: float = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss as in OpenAI baselines' PPO2 and TRL's PPOTrainer.

        V_clip = clamp(V, V_old − c, V_old + c)
        loss   = 0.5 · masked_mean(max((V − R)², (V_clip − R)²))

    Args:
        values: [B, T] current value predictions V (carries the gradient).
        old_values: [B, T] the values recorded at rollout time, V_old (detached inside).
        returns: [B, T] targets R, e.g. from `gae_advantages` (detached inside).
        mask: [B, T] 1 on completion tokens.
        clip_range_value: c.

    Returns (loss, metrics): loss, clipfrac (fraction of tokens where the clipped error is the larger one),
    values_mean, returns_mean; detached scalars.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    fmask = mask.to(values.dtype)
    keep = fmask != 0
    old_values = torch.where(keep, old_values.detach(), 0.0)
    returns = torch.where(keep, returns.detach(), 0.0)
    values_clipped = torch.clamp(values, old_values - clip_range_value, old_values + clip_range_value)
    err_unclipped = (values - returns) ** 2
    err_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(err_unclipped, err_clipped), fmask)
    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "clipfrac": masked_mean((err_clipped > err_unclipped).to(values.dtype), fmask),
            "values_mean": masked_mean(values.detach(), fmask),
            "returns_mean": masked_mean(returns, fmask),
        }
    return loss, metrics
