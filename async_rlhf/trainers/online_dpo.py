"""Asynchronous online DPO: the paper's most off-policy-robust learner, as a drop-in TRL-style trainer.

Per prompt, the generator samples `num_generations` (k >= 2) completions; the highest-scored one is chosen and
the lowest-scored one rejected (ties and prompts with fewer than two valid scores are skipped and counted), and
the DPO (sigmoid) or IPO loss is taken against a frozen reference model. The constructor is TRL 1.16's
`trl.experimental.online_dpo.OnlineDPOTrainer`'s.
"""

from __future__ import annotations

import math

import torch

from async_rlhf.config.algorithms import AsyncOnlineDPOConfig
from async_rlhf.learner.logprobs import sequence_terms
from async_rlhf.losses.dpo import dpo_loss
from async_rlhf.losses.off_policy import log_ratio_stats
from async_rlhf.scoring.rewards import best_and_worst
from async_rlhf.trainers.base import AsyncTrainerBase
from async_rlhf.types import ScoredGroup


def select_pairs(groups: list[ScoredGroup]) -> tuple[list[tuple[int, int, int]], int]:
    """(group index, chosen index, rejected index) per usable group, and the number of skipped groups (fewer than
    two finite rewards, or the best and worst rewards tie)."""
    pairs, skipped = [], 0
    for g, group in enumerate(groups):
        ranked = best_and_worst(group.rewards)
        finite = sum(math.isfinite(r) for r in group.rewards)
        if ranked is None or finite < 2 or group.rewards[ranked[0]] == group.rewards[ranked[1]]:
            skipped += 1
            continue
        pairs.append((g, *ranked))
    return pairs, skipped


class AsyncOnlineDPOTrainer(AsyncTrainerBase):
    config_class = AsyncOnlineDPOConfig
    _tag_names = ["async_rlhf", "online-dpo"]

    @property
    def beta(self) -> float:
        """TRL's: the epoch's value of `args.beta` (a list gives one per epoch, the last one repeating)."""
        return self.args.beta_at(self.state.epoch or 0.0)

    def reference_temperature(self) -> float:
        return 1.0  # the loss compares sequence log-probs at temperature 1 (its `sequence_terms` call)

    def compute_rollout_loss(self, model, groups: list[ScoredGroup], kept=None):
        a = self.args
        pairs, skipped = select_pairs(groups)
        used = pairs or [(g, 0, 1) for g in range(len(groups))]  # keep the graph (DDP) even with no pairs
        select = [(g, c) for g, c, _ in used] + [(g, r) for g, _, r in used]  # chosen rows, then rejected rows
        # chosen and rejected rows continue the same prompt: the policy runs each prompt once (shared prefix)
        t = sequence_terms(model, self.ref_model, groups, select=select, temperature=1.0,
                           sampling_temperature=a.sampling_temperature, policy_shared_prefix=True, **self.packing())
        seq, ref_seq = t.logps.sum(-1), t.ref_logps.sum(-1)
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
        for part, rows in (("chosen", slice(0, n)), ("rejected", slice(n, 2 * n))):
            drift = log_ratio_stats(t.drift_logps[rows], t.behaviour[rows], t.mask[rows])
            for k in ("log_ratio_mean", "log_ratio_abs_max", "is_weight_mean", "kl"):
                metrics[f"off_policy/{part}_{k}"] = float(drift[k])
        return loss, metrics
