"""Asynchronous PPO with a learned critic and GAE (TRL's former PPOv2, which the paper used).

Per token the reward is −β·(log π − log π_ref) and the score is added on the last completion token; GAE over the
critic's values gives advantages (whitened by default) and returns. The policy takes the clipped PPO step against
the behaviour (or proximal) log-probs; the critic takes a clipped value step. The critic is a sequence-
classification copy of the policy (its backbone initialised from the policy, its head at zero), with its own
optimizer stepped right after the policy's; it stays on the learners (generators never need it).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from async_rlhf.config.algorithms import AsyncPPOConfig
from async_rlhf.learner.logprobs import sequence_terms
from async_rlhf.learner.peft_policy import base_state_dict
from async_rlhf.losses.ppo import gae_advantages, ppo_policy_loss, ppo_value_loss, whiten
from async_rlhf.trainers.base import AsyncTrainerBase
from async_rlhf.trainers.policy_gradient import common_metrics, first_pass, policy_terms, ratio_denominator


def build_critic(policy) -> torch.nn.Module:
    import copy

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    critic = AutoModelForSequenceClassification.from_config(config)
    # shared backbone names (a LoRA policy's merged weights under its base names); lm_head is ignored
    critic.load_state_dict(base_state_dict(policy), strict=False)
    torch.nn.init.zeros_(critic.score.weight)
    return critic


def token_values(critic, input_ids, attention_mask) -> torch.Tensor:
    """V(s_t) for every position: [B, L-1], position t being the state before token t+1 (like `token_logps`)."""
    backbone = getattr(critic, critic.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return critic.score(hidden).squeeze(-1)[:, :-1].float()


class AsyncPPOTrainer(AsyncTrainerBase):
    config_class = AsyncPPOConfig
    _tag_names = ["async_rlhf", "ppo"]

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), peft_config=None,
                 value_model=None):
        super().__init__(model, ref_model=None, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers)
        if self.is_deepspeed_enabled:  # accelerate drives one DeepSpeed engine per Accelerator: the policy's
            raise NotImplementedError("AsyncPPOTrainer under DeepSpeed: the critic would need a second DeepSpeed "
                                      "engine with its own optimizer, which is not supported yet; run PPO with DDP, "
                                      "or RLOO / online DPO under DeepSpeed")
        critic = value_model if value_model is not None else build_critic(self.model)
        optimizer = self.critic_adamw(critic)
        self.critic, self.critic_optimizer = self.accelerator.prepare(critic, optimizer)

    def critic_adamw(self, critic) -> torch.optim.AdamW:
        """AdamW for the critic with the policy's settings (learning rate, betas, epsilon, weight decay on all but
        biases and norms, as the Trainer groups the policy's; TRL's PPO steps its value head in the policy's
        optimizer)."""
        a = self.args
        decay = set(self.get_decay_parameter_names(critic))
        named = [(n, p) for n, p in critic.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": a.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon)

    def compute_rollout_loss(self, model, groups, kept=None):
        a = self.args
        t = policy_terms(sequence_terms(model, self.ref_model, groups, temperature=a.sampling_temperature,
                                        sampling_temperature=a.sampling_temperature, **self.packing()), groups)
        values = token_values(self.critic, t.seq.input_ids, t.seq.attention_mask)
        # rewards, advantages, returns and the value clip's old values are the first pass's (num_iterations > 1)
        rewards, advantages, returns, old_values = first_pass(kept, "targets", lambda: self._targets(t, values))
        old, mu = ratio_denominator(t, a.off_policy_correction, kept)
        pg_loss, pm = ppo_policy_loss(t.seq.logps, old, advantages, t.mask, clip_eps=a.epsilon, behaviour_logps=mu,
                                      off_policy=a.off_policy_correction, is_cap=a.is_cap, is_floor=a.is_floor)
        vf_loss, vm = ppo_value_loss(values, old_values, returns, t.mask, clip_range_value=a.cliprange_value)
        metrics = {f"policy/{k}": float(v) for k, v in pm.items()}
        metrics.update({f"value/{k}": float(v) for k, v in vm.items()})
        metrics.update(common_metrics(t, (rewards * t.mask).sum(-1), a.beta))
        return pg_loss + a.vf_coef * vf_loss, metrics

    def _targets(self, t, values) -> tuple:
        """(per-token KL-shaped rewards, advantages, returns, values) of a micro-batch, all detached: the score on
        the last completion token, -beta * (log pi - log pi_ref) on every token, GAE over the critic's values."""
        a = self.args
        kl = (t.seq.logps.detach() - t.seq.ref_logps) * t.mask
        rewards = -a.beta * kl
        last = (t.mask.cumsum(-1) == t.mask.sum(-1, keepdim=True)) & (t.mask > 0)  # last completion token
        rewards = rewards + last.to(rewards.dtype) * t.scores[:, None]
        advantages, returns = gae_advantages(rewards, values.detach(), t.mask, a.gamma, a.lam)
        if a.whiten_advantages and int(t.mask.sum()) > 1:
            advantages = whiten(advantages, t.mask)
        return rewards, advantages, returns, values.detach()

    def after_optimizer_step(self) -> None:
        if self.nonfinite.skipped_last:  # the policy's step was skipped (non-finite): the critic's is too
            self.critic_optimizer.zero_grad(set_to_none=True)
            return
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            self.accelerator.clip_grad_norm_(self.critic.parameters(), self.args.max_grad_norm)
        self.critic_optimizer.step()
        self.critic_optimizer.zero_grad()
