"""Asynchronous RLOO: k samples per prompt, leave-one-out baseline, KL folded into the reward, PPO-style clipped update
against the behaviour (or proximal) log-probs. Constructor and config names follow TRL 1.16's RLOOTrainer.

As TRL's: batch sizes count completions (`AsyncGroupRLConfig`), reward functions get TRL's arguments
(`scoring/rewards.py::trl_reward_arguments`), an unscorable completion (every function returned None) is left out of its
siblings' baseline with advantage 0, `reward_clip_range` clamps the combined reward, and TRL's metric names are logged
(`kl`, `entropy`, `num_tokens`, `completions/*`, `clip_ratio/*` over tokens, `rewards/<name>/mean|std`, `reward`,
`reward_std`, `frac_reward_zero_std`) beside ours. Where it differs: the ratio is per token against the behaviour (or
proximal) log-probs (TRL's is one ratio per sequence against the same step's log-probs), and the clip is symmetric
(`epsilon_high` other than `epsilon` is refused).
"""

from __future__ import annotations

import torch

from async_rlhf.config.algorithms import AsyncRLOOConfig
from async_rlhf.errors import ConfigError
from async_rlhf.learner.logprobs import sequence_terms
from async_rlhf.losses.ppo import whiten
from async_rlhf.losses.rloo import kl_shaped_rewards, rloo_advantages, rloo_loss
from async_rlhf.trainers.base import AsyncTrainerBase
from async_rlhf.trainers.policy_gradient import (
    common_metrics,
    first_pass,
    finish_group_trainer,
    policy_terms,
    ratio_denominator,
    trl_metrics,
)
from async_rlhf.trainers.multi_turn import start_multi_turn
from async_rlhf.trainers.trl_compat import prepare_group_args, refuse_unbuilt


class AsyncRLOOTrainer(AsyncTrainerBase):
    config_class = AsyncRLOOConfig
    _tag_names = ["async_rlhf", "rloo"]

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None, tools=None, environment_factory=None):
        """TRL 1.16 RLOOTrainer's arguments, in its order; `quantization_config` is refused (not built here yet).
        Beyond TRL's RLOOTrainer: `tools` and `environment_factory` as GRPOTrainer takes them (multi-turn episodes,
        `trainers/multi_turn.py`)."""
        refuse_unbuilt(quantization_config=quantization_config)
        self._multi_turn = start_multi_turn(tools, environment_factory, args)
        if self._multi_turn is not None:
            reward_funcs = self._multi_turn.reward_funcs(reward_funcs)
        args = prepare_group_args(AsyncRLOOConfig, model, args, reward_funcs, reward_processing_classes)
        if args.epsilon_high is not None and args.epsilon_high != args.epsilon:
            raise ConfigError(f"epsilon_high: {args.epsilon_high} (asymmetric clipping) is not built for RLOO here; "
                              f"leave it None or equal to epsilon ({args.epsilon})")
        if reward_processing_classes is not None and not isinstance(reward_processing_classes, list):
            reward_processing_classes = [reward_processing_classes]
        super().__init__(model, ref_model=None, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers)
        finish_group_trainer(self)
        self.normalize_advantages = self.args.normalize_advantages
        self.reward_clip_range = self.args.reward_clip_range

    def compute_rollout_loss(self, model, groups, kept=None):
        a = self.args
        first = not kept  # the step's first pass over these groups
        t = policy_terms(sequence_terms(model, self.ref_model, groups, temperature=a.sampling_temperature,
                                        sampling_temperature=a.sampling_temperature, **self.packing()), groups)
        dev = t.seq.mask.device
        raw = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float32, device=dev)
        raw = torch.where(torch.isfinite(raw), raw, torch.nan)  # unscorable: out of the baseline (TRL)
        if a.reward_clip_range is not None:
            raw = raw.clamp(min=a.reward_clip_range[0], max=a.reward_clip_range[1])
        mask = t.seq.mask
        if a.mask_truncated_completions:
            finished = torch.tensor([c.finish_reason != "length" for c in t.seq.completions], device=dev)
            mask = mask * finished[:, None].to(mask.dtype)
        # the KL-shaped rewards and advantages of the first pass: later passes (num_iterations > 1) keep them
        shaped = first_pass(kept, "shaped", lambda: kl_shaped_rewards(raw, t.seq.logps.detach(), t.seq.ref_logps,
                                                                      mask, a.beta))
        grouped = shaped.view(len(groups), a.num_generations)
        advantages = first_pass(kept, "advantages", lambda: rloo_baselined(grouped, a.normalize_advantages))
        old, mu = ratio_denominator(t, a.off_policy_correction, kept)
        loss, m = rloo_loss(t.seq.logps, old, advantages, mask, clip_eps=a.epsilon, behaviour_logps=mu,
                            off_policy=a.off_policy_correction, is_cap=a.is_cap, is_floor=a.is_floor)
        metrics = {f"policy/{k}": float(v) for k, v in m.items()}
        finite = raw[torch.isfinite(raw)]
        metrics["reward"] = finite.mean().item() if finite.numel() else 0.0
        metrics["reward_std"] = finite.std().item() if finite.numel() > 1 else 0.0
        std = torch.stack([g[torch.isfinite(g)].std() if torch.isfinite(g).sum() > 1 else torch.tensor(0.0)
                           for g in grouped])
        metrics["frac_reward_zero_std"] = torch.isclose(std, torch.zeros_like(std)).float().mean().item()
        with torch.no_grad():  # TRL's clip names, over tokens (ours clips per token; TRL's ratio is per sequence)
            ratio = torch.exp(torch.where(mask != 0, t.seq.logps.detach() - old, 0.0))
            adv = advantages[:, None]
            low = ((ratio < 1 - a.epsilon) & (adv < 0)).float() * mask
            high = ((ratio > 1 + a.epsilon) & (adv > 0)).float() * mask
            tokens, per_seq = mask.sum().clamp(min=1), mask.sum(-1).clamp(min=1)
            rows = mask.sum(-1) > 0
            metrics["clip_ratio/low_mean"] = (low.sum() / tokens).item()
            metrics["clip_ratio/high_mean"] = (high.sum() / tokens).item()
            metrics["clip_ratio/region_mean"] = (torch.maximum(low, high).sum() / tokens).item()
            if rows.any():
                metrics["clip_ratio/low_min"] = (low.sum(-1) / per_seq)[rows].min().item()
                metrics["clip_ratio/high_max"] = (high.sum(-1) / per_seq)[rows].max().item()
        if a.beta != 0.0:  # TRL: the first-order per-token KL, masked mean
            kl = (t.seq.logps.detach() - t.seq.ref_logps) * mask
            metrics["kl"] = (kl.sum() / mask.sum().clamp(min=1)).item()
        metrics.update(trl_metrics(self, t, count_tokens=first))
        metrics.update(common_metrics(t, torch.nan_to_num(shaped, nan=0.0), a.beta))
        return loss, metrics


def rloo_baselined(grouped: torch.Tensor, normalize: bool) -> torch.Tensor:
    """[P*k] advantages from [P, k] KL-shaped rewards: leave-one-out baselines, whitened over the scorable
    completions when `normalize`; 0 for an unscorable completion (NaN reward)."""
    advantages = rloo_advantages(grouped).reshape(-1)
    scorable = torch.isfinite(advantages)
    if normalize and int(scorable.sum()) > 1:
        advantages = whiten(torch.nan_to_num(advantages, nan=0.0), scorable.to(advantages.dtype))
    return torch.nan_to_num(advantages, nan=0.0) * scorable.to(advantages.dtype)
