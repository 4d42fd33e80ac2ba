"""Asynchronous online DPO: the paper's most off-policy-robust learner, as a drop-in TRL-style trainer.

Per prompt, the generator samples `num_generations` (k >= 2) completions; the highest-scored one is chosen and
the lowest-scored one rejected (ties and prompts with fewer than two valid scores are skipped and counted), and
the DPO (sigmoid) or IPO loss is taken against a frozen reference model. The constructor is TRL 1.16's
`trl.experimental.online_dpo.OnlineDPOTrainer`'s.
"""

from __future__ import annotations

import math

import torch

from async_rlhf.config import AsyncOnlineDPOConfig
from async_rlhf.logprobs import behaviour_logps, completion_batch, token_logps
from async_rlhf.losses.dpo import dpo_loss
from async_rlhf.losses.off_policy import log_ratio_stats
from async_rlhf.trainers.base import AsyncTrainerBase
from async_rlhf.types import ScoredGroup


def select_pairs(groups: list[ScoredGroup]) -> tuple[list[tuple[int, int, int]], int]:
    """(group index, chosen index, rejected index) per usable group, and the number of skipped groups."""
    pairs, skipped = [], 0
    for g, group in enumerate(groups):
        valid = [(r, i) for i, r in enumerate(group.rewards) if math.isfinite(r)]
        if len(valid) < 2:
            skipped += 1
            continue
        best, worst = max(valid), min(valid)
        if best[0] == worst[0]:
            skipped += 1
            continue
        pairs.append((g, best[1], worst[1]))
    return pairs, skipped


class AsyncOnlineDPOTrainer(AsyncTrainerBase):
    config_class = AsyncOnlineDPOConfig
    _tag_names = ["async_rlhf", "online-dpo"]

    def compute_rollout_loss(self, model, groups: list[ScoredGroup]):
        a = self.args
        pairs, skipped = select_pairs(groups)
        used = pairs or [(g, 0, 1) for g in range(len(groups))]  # keep the graph (DDP) even with no pairs
        select = [(g, c) for g, c, _ in used] + [(g, r) for g, _, r in used]  # chosen rows, then rejected rows
        input_ids, attention, comp_mask, completions = completion_batch(
            groups, self.processing_class.pad_token_id, a.max_length, self.accelerator.device, select)
        logps, mask, drift_logps = token_logps(model, input_ids, attention, comp_mask,
                                               drift_temperature=a.temperature)
        with torch.no_grad():
            ref_logps, _, _ = token_logps(self.ref_model, input_ids, attention, comp_mask)
        seq, ref_seq = logps.sum(-1), ref_logps.sum(-1)
        n = len(used)
        beta = a.beta_at(self.state.epoch or 0.0)
        loss, m = dpo_loss(seq[:n], seq[n:], ref_seq[:n], ref_seq[n:], beta, a.loss_type)
        if not pairs:
            loss = loss * 0.0
        metrics = {k: float(v) for k, v in m.items()}
        # TRL's objective/* names: scores over all sampled completions, KL = log π - log π_ref summed per sequence
        scores = torch.tensor([r for grp in groups for r in grp.rewards if math.isfinite(r)])
        kl = (seq - ref_seq).detach().mean().item()
        metrics.update({
            "objective/scores": scores.mean().item() if len(scores) else 0.0,
            "objective/scores_margin": (sum(groups[g].rewards[c] - groups[g].rewards[r] for g, c, r in pairs)
                                        / len(pairs)) if pairs else 0.0,
            "objective/kl": kl,
            "objective/non_score_reward": -beta * kl,
            "objective/rlhf_reward": (scores.mean().item() if len(scores) else 0.0) - beta * kl,
            "learner/pairs": float(len(pairs)),
            "learner/skipped_groups": float(skipped),
            "beta": beta,
        })
        behaviour = behaviour_logps(completions, mask)
        for part, rows in (("chosen", slice(0, n)), ("rejected", slice(n, 2 * n))):
            drift = log_ratio_stats(drift_logps[rows], behaviour[rows], mask[rows])
            for k in ("log_ratio_mean", "log_ratio_abs_max", "is_weight_mean", "kl"):
                metrics[f"off_policy/{part}_{k}"] = float(drift[k])
        return loss, metrics
