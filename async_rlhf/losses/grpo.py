"""GRPO: group-relative advantages and the clipped surrogate with TRL 1.16's loss types and normalisations.

Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300, Sec. 4.1, eq. 3): each prompt gets a group of k completions;
a completion's advantage is its reward minus the group's mean, divided by the group's standard deviation
(`grpo_advantages`). The update is PPO's clipped ratio objective with that advantage on every token, plus β times
the "k3" estimate of KL(π ‖ π_ref) per token (Schulman 2020, http://joschu.net/blog/kl-approx.html), added to the
loss rather than folded into the reward.

What TRL 1.16's `GRPOTrainer` adds, mirrored here with its names:
- `scale_rewards`: "group" (eq. 3), "batch" (one std over the batch: PPO-Lite), "none" (Dr. GRPO, arXiv:2503.20783).
- asymmetric clipping `epsilon_low` / `epsilon_high` (DAPO, arXiv:2503.14476) and the two-sided cap `delta`
  (INTELLECT-2, arXiv:2505.07291); `importance_sampling_level="sequence"` (GSPO: one ratio per sequence, the
  geometric mean of its token ratios).
- `loss_type`, which is how the token terms are summed:
    "grpo":    mean over each sequence's tokens, then mean over sequences (length-biased);
    "bnpo":    mean over the batch's tokens (this micro-batch);
    "dr_grpo": sum over tokens / (sequences · max_completion_length);
    "dapo":    sum over tokens / the number of tokens of the whole step's batch (`num_items`), so every token of
               the step weighs the same whatever micro-batch or rank it lands on;
    "cispo":   -clip(r, max=ε_high)·A·log π (detached weight, MiniMax-M1, arXiv:2506.13585), normalised as "dapo";
    "sapo":    soft gate -σ(τ(r − 1))·4/τ·A (arXiv:2511.20347), τ by the advantage's sign, normalised as "grpo".
- `use_bias_correction_kl`: the KL term multiplied by the (differentiable) ratio r.

The asynchronous part is the same as `ppo.ppo_policy_loss`: the ratio r = π/`old_logps`, and `off_policy` "tis" /
"decoupled" / "masked" multiply each token's policy term (not the KL term, as TRL's vLLM importance weights) by the
detached π_prox/μ, truncated at / dropped above `is_cap` / dropped outside [`is_floor`, `is_cap`]
(`off_policy.off_policy_weights`).

Shapes: B = sequences, T = completion tokens, P = prompts, k = completions per prompt. Masks bool or float [B, T].
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_rlhf.losses.off_policy import OFF_POLICY_MODES, check_same_shape, masked_mean, off_policy_weights

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


def _nanstd(x: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (TRL's `nanstd`): NaN with fewer than two values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    std = torch.sqrt(var * count / (count - 1))
    return std if keepdim or dim is None else std.squeeze(dim)


def grpo_advantages(rewards: Tensor, scale_rewards: str = "group") -> tuple[Tensor, Tensor]:
    """Group-relative advantages A_i = (r_i − mean_group(r)) / (std + 1e-4), as TRL 1.16 computes them.

    Args:
        rewards: [P, k] combined reward per completion, one row per prompt; NaN marks an unscorable completion
            (a skipped reward): it is left out of its group's mean and std, and its advantage is 0.
        scale_rewards: "group" (std of the row), "batch" (std of every reward in `rewards`) or "none" (no division).
            Stds are Bessel-corrected.

    Returns: (advantages [P, k] detached, std_is_zero [P, k] bool: the std used, or that would be used for "none",
    is 0, i.e. the group carries no signal; logged as TRL's frac_reward_zero_std).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, k], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"GRPO needs k >= 2 completions per prompt, got k={rewards.shape[1]}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; valid: {', '.join(SCALE_REWARDS)}")
    with torch.no_grad():
        rewards = rewards.detach().float()
        centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
        if scale_rewards == "batch":
            std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = _nanstd(rewards, dim=1, keepdim=True).expand_as(rewards)
        advantages = centred if scale_rewards == "none" else centred / (std + STD_EPS)
        return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    behaviour_logps: Tensor | None = None,
    off_policy: str = "none",
    is_cap: float | None = 2.0,
    is_floor: float = 0.0,
    max_completion_length: int | None = None,
    num_items: float | Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO loss of one micro-batch (see the module docstring for each `loss_type`).

    With r = exp(log_w), log_w = logps − old_logps per token ("token") or its masked mean per sequence
    ("sequence", broadcast over the tokens), the clipped types' token term is
        ℓ_t = −min(min(r, δ)·A, clip(r, 1 − ε_low, 1 + ε_high)·A)      (min(r, δ) only when `delta` is set)
    times the off-policy weight w_t ("tis" / "decoupled" / "masked"), plus β·kl_t with
        kl_t = exp(ref − logps) − (ref − logps) − 1   (× r when use_bias_correction_kl).

    Args:
        logps: [B, T] log π_θ of the sampled tokens; the only input with gradient.
        old_logps: [B, T] the ratio's denominator: the behaviour log-probs μ ("none") or the proximal policy.
        advantages: [B] one per sequence, e.g. `grpo_advantages(rewards)[0].reshape(-1)`.
        mask: [B, T] 1 on the tokens that count.
        epsilon_high: defaults to epsilon_low. For "cispo" it is the cap of the detached weight.
        ref_logps: [B, T] frozen reference; required when beta != 0.
        behaviour_logps, off_policy, is_cap, is_floor: as in `ppo.ppo_policy_loss`.
        max_completion_length: the constant of "dr_grpo" (required there).
        num_items: "dapo" / "cispo": the token count the sum is divided by (default: this micro-batch's mask sum).

    Returns (loss, metrics), metrics detached scalars: loss, kl (masked mean of kl_t, when beta != 0), ratio_mean,
    clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (fraction of tokens whose clip is active:
    r < 1 − ε_low with A < 0, r > 1 + ε_high with A > 0; "cispo": cispo_clip_ratio), clip_ratio/low_min and
    clip_ratio/high_max (the smallest / largest such fraction of one sequence, TRL's names), and with a correction
    is_weight_mean, is_capped_frac, is_ess.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; valid: "
                         f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
    if off_policy not in OFF_POLICY_MODES:
        raise ValueError(f"unknown off_policy {off_policy!r}; valid: {', '.join(OFF_POLICY_MODES)}")
    check_same_shape(logps=logps, old_logps=old_logps, mask=mask)
    if advantages.dim() != 1 or advantages.shape[0] != logps.shape[0]:
        raise ValueError(f"advantages must be [B] with B={logps.shape[0]}, got shape {tuple(advantages.shape)}")
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError(f"beta={beta} needs ref_logps")
        check_same_shape(logps=logps, ref_logps=ref_logps)
    if (off_policy == "none") != (behaviour_logps is None):
        raise ValueError(f"off_policy={off_policy!r}: behaviour_logps must be given exactly for a correction "
                         "(for 'none' pass the behaviour log-probs as old_logps)")
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (its normalising constant)")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high

    fmask = mask.to(logps.dtype)
    keep = fmask != 0
    zero = torch.zeros((), dtype=logps.dtype, device=logps.device)
    old_logps = old_logps.detach()
    adv = advantages.detach().to(logps.dtype)[:, None]  # [B, 1]
    log_ratio = torch.where(keep, logps - old_logps, zero)  # padding may hold anything: neutralised first
    if importance_sampling_level == "sequence":
        log_w = ((log_ratio * fmask).sum(-1) / fmask.sum(-1).clamp(min=1.0))[:, None]  # [B, 1]
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    metrics: dict[str, Tensor] = {}

    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=epsilon_high).detach() * adv * torch.where(keep, logps, zero)
    elif loss_type == "sapo":
        temperatures = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg).to(logps.dtype)
        per_token = -torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures * adv
    else:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        capped = torch.clamp(coef_1, max=delta) if delta is not None else coef_1
        per_token = -torch.min(capped * adv, coef_2 * adv)
    per_token = per_token.expand_as(logps)

    if off_policy != "none":
        check_same_shape(logps=logps, behaviour_logps=behaviour_logps)
        weights, weight_metrics = off_policy_weights(old_logps, behaviour_logps, fmask, off_policy, is_cap, is_floor)
        per_token = per_token * weights
        metrics.update(weight_metrics)

    if beta != 0.0:
        d = torch.where(keep, ref_logps.detach() - logps, zero)
        per_token_kl = torch.exp(d) - d - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        per_token = per_token + beta * per_token_kl
        metrics["kl"] = masked_mean(per_token_kl.detach(), fmask)

    summed = per_token * fmask
    if loss_type in ("grpo", "sapo"):
        loss = (summed.sum(-1) / fmask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = summed.sum() / fmask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = summed.sum() / (logps.shape[0] * max_completion_length)
    else:  # dapo, cispo
        denominator = fmask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logps.dtype)
        loss = summed.sum() / denominator.clamp(min=1.0)

    with torch.no_grad():
        metrics["loss"] = loss.detach()
        ratio = coef_1.detach().expand_as(logps)
        metrics["ratio_mean"] = masked_mean(ratio, fmask)
        if loss_type == "cispo":
            metrics["cispo_clip_ratio"] = masked_mean(((ratio > epsilon_high) & (adv > 0)).to(logps.dtype), fmask)
        elif loss_type != "sapo":
            low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(logps.dtype)
            high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(logps.dtype)
            metrics["clip_ratio/low_mean"] = masked_mean(low, fmask)
            metrics["clip_ratio/high_mean"] = masked_mean(high, fmask)
            metrics["clip_ratio/region_mean"] = masked_mean(torch.maximum(low, high), fmask)
            rows = fmask.sum(-1) > 0  # TRL: each sequence's clipped fraction, then the min (low) / max (high)
            seq_count = fmask.sum(-1).clamp(min=1.0)
            if rows.any():
                metrics["clip_ratio/low_min"] = ((low * fmask).sum(-1) / seq_count)[rows].min()
                metrics["clip_ratio/high_max"] = ((high * fmask).sum(-1) / seq_count)[rows].max()
    return loss, metrics
