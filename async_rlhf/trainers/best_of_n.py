"""Asynchronous Best-of-N SFT (the paper's Best-of-2): sample N completions per prompt, keep the highest-scored,
and train on it with the negative log-likelihood. No reference model enters the loss; KL is logged only."""

from __future__ import annotations

import math

import torch

from async_rlhf.config.algorithms import AsyncBestOfNConfig
from async_rlhf.learner.logprobs import sequence_terms
from async_rlhf.losses.off_policy import log_ratio_stats
from async_rlhf.losses.sft import best_of_n_nll
from async_rlhf.scoring.rewards import best_and_worst
from async_rlhf.trainers.base import AsyncTrainerBase


class AsyncBestOfNTrainer(AsyncTrainerBase):
    config_class = AsyncBestOfNConfig
    _tag_names = ["async_rlhf", "best-of-n"]

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), peft_config=None):
        super().__init__(model, ref_model=None, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers)

    def reference_temperature(self) -> float:
        return 1.0  # the loss compares sequence log-probs at temperature 1 (its `sequence_terms` call)

    def compute_rollout_loss(self, model, groups, kept=None):
        a = self.args
        best = []  # (group, best completion, has a finite reward); a group without one keeps a row, masked out
        for g, group in enumerate(groups):
            ranked = best_and_worst(group.rewards)
            best.append((g, ranked[0] if ranked else 0, ranked is not None))
        t = sequence_terms(model, self.ref_model, groups, select=[(g, i) for g, i, _ in best], temperature=1.0,
                           sampling_temperature=a.sampling_temperature, **self.packing())
        keep = torch.tensor([ok for _, _, ok in best], device=t.mask.device, dtype=t.mask.dtype)
        loss, m = best_of_n_nll(t.logps, t.mask * keep[:, None])
        kl = ((t.logps.detach() - t.ref_logps) * t.mask).sum(-1).mean().item()
        chosen = [groups[g].rewards[i] for g, i, ok in best if ok]
        scores = [r for grp in groups for r in grp.rewards if math.isfinite(r)]
        metrics = {f"policy/{k}": float(v) for k, v in m.items()}
        metrics.update({
            "objective/scores": sum(scores) / len(scores) if scores else 0.0,
            "objective/best_scores": sum(chosen) / len(chosen) if chosen else 0.0,
            "objective/kl": kl,
        })
        drift_stats = log_ratio_stats(t.drift_logps, t.behaviour, t.mask)
        metrics.update({f"off_policy/{k}": float(drift_stats[k]) for k in ("log_ratio_mean", "log_ratio_abs_max")})
        return loss, metrics
