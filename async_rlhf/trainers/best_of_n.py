"""Asynchronous Best-of-N SFT (the paper's Best-of-2): sample N completions per prompt, keep the highest-scored,
and train on it with the negative log-likelihood. No reference model enters the loss; KL is logged only."""

from __future__ import annotations

import math

import torch

from async_rlhf.config import AsyncBestOfNConfig
from async_rlhf.logprobs import behaviour_logps, completion_batch, token_logps
from async_rlhf.losses.off_policy import log_ratio_stats
from async_rlhf.losses.sft import best_of_n_nll
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

    def compute_rollout_loss(self, model, groups):
        a = self.args
        best = []
        for g, group in enumerate(groups):
            valid = [(r, i) for i, r in enumerate(group.rewards) if math.isfinite(r)]
            best.append((g, max(valid)[1] if valid else 0, bool(valid)))
        ids, attn, cmask, comps = completion_batch(groups, self.processing_class.pad_token_id, a.max_length,
                                                   self.accelerator.device, [(g, i) for g, i, _ in best])
        logps, mask, drift = token_logps(model, ids, attn, cmask, drift_temperature=a.temperature)
        keep = torch.tensor([ok for _, _, ok in best], device=mask.device, dtype=mask.dtype)
        loss, m = best_of_n_nll(logps, mask * keep[:, None])
        with torch.no_grad():
            ref, _, _ = token_logps(self.ref_model, ids, attn, cmask)
        kl = ((logps.detach() - ref) * mask).sum(-1).mean().item()
        chosen = [groups[g].rewards[i] for g, i, ok in best if ok]
        scores = [r for grp in groups for r in grp.rewards if math.isfinite(r)]
        metrics = {f"policy/{k}": float(v) for k, v in m.items()}
        metrics.update({
            "objective/scores": sum(scores) / len(scores) if scores else 0.0,
            "objective/best_scores": sum(chosen) / len(chosen) if chosen else 0.0,
            "objective/kl": kl,
        })
        drift_stats = log_ratio_stats(drift, behaviour_logps(comps, mask), mask)
        metrics.update({f"off_policy/{k}": float(drift_stats[k]) for k in ("log_ratio_mean", "log_ratio_abs_max")})
        return loss, metrics
