"""What the policy-gradient learners (RLOO, PPO, GRPO) share: the per-token log-prob terms of a micro-batch and the
choice of the ratio's denominator under each off-policy correction.

For a stale sample three policies matter: the behaviour policy μ that the generator sampled from (its log-probs
travel with the rollout), the proximal policy π_prox (the learner's weights before this update: with one
optimizer step per batch it is the current forward pass, detached), and the policy π being trained.
- "none": the PPO ratio is π/μ, clipped: plain PPO on whatever data arrived.
- "tis", "decoupled", "masked": the ratio is π/π_prox, clipped, and each token is weighted by π_prox/μ (truncated
  at `is_cap` / dropped above it / dropped outside [`is_floor`, `is_cap`]); see `losses/off_policy.py`.
With `num_iterations` > 1 the step makes that many optimizer passes over its batch; π_prox and the advantages are
those of the first pass (`first_pass`), so the clip binds from the second pass on (AReaL's decoupled PPO).
Every step logs `off_policy/is_ess`, the effective sample size of the raw weights π/μ (1 on-policy), whatever the
correction; with one, `policy/is_ess` is that of the weights the loss applied.

`trl_metrics` adds the names TRL 1.16's GRPOTrainer and RLOOTrainer log (GRPO and RLOO log them beside ours):
`num_tokens` (prompt + completion tokens trained so far, every rank), `completions/{mean,min,max}_length`,
`completions/clipped_ratio`, `completions/{mean,min,max}_terminated_length`, `entropy` and, with beta != 0, `kl`.
`entropy` here is the sampled tokens' mean -log π (a Monte Carlo estimate of the policy's entropy at the sampling
temperature: TRL's is the exact entropy of each position's distribution, which our forwards do not keep).

`SyncReference` is TRL's `sync_ref_model` for the group learners (GRPO, RLOO).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from transformers import TrainerCallback

from async_rlhf.errors import ConfigError
from async_rlhf.learner.logprobs import SequenceTerms
from async_rlhf.losses.off_policy import log_ratio_stats
from async_rlhf.scoring.rewards import trl_reward_arguments
from async_rlhf.types import ScoredGroup


@dataclass
class PolicyTerms:
    seq: SequenceTerms  # every completion of every group, at the sampling temperature
    mask: torch.Tensor  # [B, L-1] seq.mask on the rows of valid groups only
    scores: torch.Tensor  # [B] reward per completion, 0 where invalid
    valid: torch.Tensor  # [B] bool: the completion's group has only finite rewards


def policy_terms(seq: SequenceTerms, groups: list[ScoredGroup]) -> PolicyTerms:
    """A group with any non-finite reward (a skipped sample) is left out whole: its baseline would be wrong."""
    group_ok = [all(math.isfinite(r) for r in g.rewards) for g in groups]
    valid = torch.tensor([ok for g, ok in zip(groups, group_ok) for _ in g.completions], device=seq.mask.device)
    scores = torch.tensor([r if ok else 0.0 for g, ok in zip(groups, group_ok) for r in g.rewards],
                          device=seq.mask.device)
    return PolicyTerms(seq, seq.mask * valid[:, None].to(seq.mask.dtype), scores, valid)


def ratio_denominator(t: PolicyTerms, correction: str,
                      kept: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(old_logps, behaviour_logps) for `ppo_policy_loss` under `correction`. The proximal policy is the learner
    before the step: this forward, detached, in the step's first pass, and kept for its later passes (`kept`, see
    `first_pass`)."""
    if correction == "none":
        return t.seq.behaviour, None
    return first_pass(kept, "proximal", lambda: t.seq.logps.detach()), t.seq.behaviour


def first_pass(kept: dict | None, name: str, compute):
    """`compute()` as the step's first pass over a micro-batch has it: computed then and kept in `kept` for the
    later passes of num_iterations > 1 (`AsyncTrainerBase.further_passes`); computed every time when `kept` is None
    (one pass)."""
    if kept is None:
        return compute()
    if name not in kept:
        kept[name] = compute()
    return kept[name]


def common_metrics(t: PolicyTerms, shaped: torch.Tensor, beta: float) -> dict[str, float]:
    """TRL-named objective metrics plus behaviour-vs-learner drift (what staleness costs)."""
    rows = t.valid
    kl = ((t.seq.logps.detach() - t.seq.ref_logps) * t.mask).sum(-1)
    out = {
        "objective/scores": t.scores[rows].mean().item() if rows.any() else 0.0,
        "objective/kl": kl[rows].mean().item() if rows.any() else 0.0,
        "objective/non_score_reward": -beta * (kl[rows].mean().item() if rows.any() else 0.0),
        "objective/rlhf_reward": shaped[rows].mean().item() if rows.any() else 0.0,
        "learner/valid_fraction": rows.float().mean().item(),
    }
    drift = log_ratio_stats(t.seq.logps.detach(), t.seq.behaviour, t.mask)
    for k in ("log_ratio_mean", "log_ratio_abs_max", "is_weight_mean", "is_weight_max", "kl", "is_ess"):
        out[f"off_policy/{k}"] = float(drift[k])
    return out


def trl_metrics(trainer, t: PolicyTerms, count_tokens: bool = True) -> dict[str, float]:
    """TRL's metric names for this micro-batch (module docstring; each learner adds its own `kl`); sets the
    trainer's `num_tokens` itself (a running total, not a mean over the logging window), counting the micro-batch's
    tokens when `count_tokens` (its first pass)."""
    mask = t.seq.mask
    lengths = torch.tensor([float(c.num_sampled) for c in t.seq.completions])  # TRL: tool answers not counted
    truncated = torch.tensor([c.finish_reason == "length" for c in t.seq.completions])
    terminated = lengths[~truncated]
    out = {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item() if terminated.numel() else 0.0,
        "completions/min_terminated_length": terminated.min().item() if terminated.numel() else 0.0,
        "completions/max_terminated_length": terminated.max().item() if terminated.numel() else 0.0,
        "entropy": (-(t.seq.logps.detach() * mask).sum() / mask.sum().clamp(min=1)).item(),
    }
    out.update(episode_metrics(t.seq.completions))
    if not count_tokens:
        return out
    answers = sum(len(c.token_ids) - c.num_sampled for c in t.seq.completions)  # TRL: prompts and sampled tokens
    tokens = torch.tensor(float(t.seq.attention_mask.sum()) - answers, device=mask.device)
    if trainer.accelerator.num_processes > 1:  # every rank computes a micro-batch in step: a safe collective
        tokens = trainer.accelerator.reduce(tokens, reduction="sum")
    trainer.state.num_input_tokens_seen += int(tokens.item())
    trainer._metrics["num_tokens"] = [float(trainer.state.num_input_tokens_seen)]
    return out


def episode_metrics(completions) -> dict[str, float]:
    """Multi-turn episodes' metrics (none for single-turn samples): TRL's `tools/call_frequency` (calls per sample)
    and `tools/failure_frequency` (failed calls per call), and ours: turns per episode, timed-out calls per call,
    unscorable episodes (an environment's `reset` or `get_reward` raised) per episode, episodes whose turns more
    than one weight version sampled (`weight_load='in_flight'`) per episode."""
    episodes = [c.episode for c in completions if c.episode]
    if not episodes:
        return {}
    calls = sum(e["tool_calls"] for e in episodes)
    return {"tools/call_frequency": calls / len(episodes),
            "tools/failure_frequency": sum(e["tool_failures"] for e in episodes) / calls if calls else 0.0,
            "episodes/turns": sum(e["turns"] for e in episodes) / len(episodes),
            "episodes/tool_timeout_frequency": sum(e["tool_timeouts"] for e in episodes) / calls if calls else 0.0,
            "episodes/unscorable": sum(bool(e["error"]) for e in episodes) / len(episodes),
            "episodes/spanning_versions": sum(len(c.version_starts) > 1 for c in completions if c.episode)
            / len(episodes)}


class SyncReference(TrainerCallback):
    """TRL's `sync_ref_model` (TR-DPO, arXiv:2404.09656): after every `ref_model_sync_steps`-th optimizer step,
    π_ref ← α·π + (1 − α)·π_ref with α = `ref_model_mixup_alpha`, as TRL's `SyncRefModelCallback`. The reference is
    not checkpointed (nor is TRL's): a resumed run starts it again from the initial policy. Refused where the
    reference is not a plain module of this process that only the main thread reads: a LoRA policy (the reference
    is the base with adapters off), DeepSpeed engines, a schedule whose scoring thread runs it."""

    def __init__(self, trainer):
        if trainer.ref_model is None:
            raise ConfigError("sync_ref_model: a LoRA policy's reference is its base with the adapters off; there is "
                              "no separate reference to sync")
        if trainer.is_deepspeed_enabled:
            raise ConfigError("sync_ref_model: not built under DeepSpeed (the reference is an engine of its own)")
        if trainer.fuses_reference():
            raise ConfigError("sync_ref_model: the scoring thread runs the reference here (an optional schedule), "
                              "while the sync would change it; turn that schedule off")
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            policy = self.trainer.accelerator.unwrap_model(self.trainer.model)
            mix_into(self.trainer.ref_model, policy, args.ref_model_mixup_alpha)


@torch.no_grad()
def mix_into(target: torch.nn.Module, source: torch.nn.Module, alpha: float) -> None:
    """target ← alpha·source + (1 − alpha)·target, parameter by parameter (both with the same parameters)."""
    for t, s in zip(target.parameters(), source.parameters(), strict=True):
        t.mul_(1.0 - alpha).add_(s.detach().to(t.dtype), alpha=alpha)


def finish_group_trainer(trainer) -> None:
    """What TRL's GRPO and RLOO trainers share once built: reward functions get TRL's arguments, TRL's reference sync
    (`sync_ref_model`) as a callback, and TRL's public attributes read from the config."""
    a = trainer.args
    trl_reward_arguments(trainer.scorer, trainer)
    if a.sync_ref_model:
        trainer.add_callback(SyncReference(trainer))
    trainer.num_generations = a.num_generations
    trainer.beta = a.beta
    trainer.epsilon_low = a.epsilon
    trainer.epsilon_high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
    trainer.max_completion_length = a.max_new_tokens
    trainer.mask_truncated_completions = a.mask_truncated_completions
