"""Asynchronous RLOO: k samples per prompt, leave-one-out baseline, KL folded into the reward, PPO-style clipped
update against the behaviour (or proximal) log-probs. Constructor and config names follow TRL 1.16's RLOOTrainer.
"""

from __future__ import annotations

from async_rlhf.config.algorithms import AsyncRLOOConfig
from async_rlhf.learner.logprobs import sequence_terms
from async_rlhf.losses.ppo import whiten
from async_rlhf.losses.rloo import kl_shaped_rewards, rloo_advantages, rloo_loss
from async_rlhf.trainers.base import AsyncTrainerBase
from async_rlhf.trainers.policy_gradient import common_metrics, policy_terms, ratio_denominator


class AsyncRLOOTrainer(AsyncTrainerBase):
    config_class = AsyncRLOOConfig
    _tag_names = ["async_rlhf", "rloo"]

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), peft_config=None):
        super().__init__(model, ref_model=None, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers)

    def compute_rollout_loss(self, model, groups):
        a = self.args
        t = policy_terms(sequence_terms(model, self.ref_model, groups, temperature=a.temperature,
                                        sampling_temperature=a.temperature, **self.packing()), groups)
        shaped = kl_shaped_rewards(t.scores, t.seq.logps.detach(), t.seq.ref_logps, t.mask, a.beta)
        advantages = rloo_advantages(shaped.view(len(groups), a.num_generations)).reshape(-1)
        advantages = advantages * t.valid.to(advantages.dtype)
        if a.normalize_advantages and int(t.valid.sum()) > 1:
            advantages = whiten(advantages, t.valid.to(advantages.dtype))
        old, mu = ratio_denominator(t, a.off_policy_correction)
        loss, m = rloo_loss(t.seq.logps, old, advantages, t.mask, clip_eps=a.epsilon, behaviour_logps=mu,
                            off_policy=a.off_policy_correction, is_cap=a.is_cap)
        metrics = {f"policy/{k}": float(v) for k, v in m.items()}
        metrics.update(common_metrics(t, shaped, a.beta))
        return loss, metrics
