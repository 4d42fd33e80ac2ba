"""Asynchronous GRPO: k samples per prompt, group-relative advantages, clipped update against the behaviour (or
proximal) log-probs, k3 KL to the reference in the loss. Constructor and config names follow TRL 1.16's GRPOTrainer
and GRPOConfig; the loss is `losses/grpo.py`.

Where it differs from TRL's GRPOTrainer, because generation here is asynchronous:
- the ratio's denominator is the generator's behaviour log-prob μ (`off_policy_correction="none"`), or the learner
  before the update with π_prox/μ weights ("tis", "decoupled"), as for RLOO and PPO; TRL's on-policy step has
  ratio 1 and corrects vLLM's mismatch with its own importance weights;
- `scale_rewards="batch"` takes the std over this rank's micro-batch, TRL's over the whole generation batch (the
  same with one process and gradient_accumulation_steps 1);
- rewards are combined (weighted sum of `reward_funcs` with `reward_weights`) before the advantage, TRL's default
  `multi_objective_aggregation="sum_then_normalize"`.

As TRL: batch sizes count completions (`AsyncGroupRLConfig`), reward functions get TRL's arguments
(`scoring/rewards.py::trl_reward_arguments`), and TRL's metric names are logged (`kl`, `entropy`, `num_tokens`,
`completions/*`, `clip_ratio/*`, `rewards/<name>/mean|std`, `reward`, `reward_std`, `frac_reward_zero_std`) beside
ours (`policy/*`, `objective/*`, `off_policy/*`).
"""

from __future__ import annotations

import torch

from async_rlhf.config.algorithms import AsyncGRPOConfig
from async_rlhf.learner.logprobs import sequence_terms
from async_rlhf.losses.grpo import grpo_advantages, grpo_loss
from async_rlhf.trainers.base import AsyncTrainerBase
from async_rlhf.trainers.multi_turn import start_multi_turn
from async_rlhf.trainers.policy_gradient import (
    common_metrics,
    finish_group_trainer,
    policy_terms,
    ratio_denominator,
    trl_metrics,
)
from async_rlhf.trainers.trl_compat import prepare_group_args, refuse_unbuilt


class AsyncGRPOTrainer(AsyncTrainerBase):
    config_class = AsyncGRPOConfig
    _tag_names = ["async_rlhf", "grpo"]

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        """TRL 1.16 GRPOTrainer's arguments, in its order. `tools` and `environment_factory`: multi-turn episodes run
        in the generators (`trainers/multi_turn.py`). Not built here yet, refused with a message:
        `quantization_config` and `rollout_func`."""
        refuse_unbuilt(quantization_config=quantization_config, rollout_func=rollout_func)
        self._multi_turn = start_multi_turn(tools, environment_factory, args)
        if self._multi_turn is not None:
            reward_funcs = self._multi_turn.reward_funcs(reward_funcs)
        args = prepare_group_args(AsyncGRPOConfig, model, args, reward_funcs, reward_processing_classes)
        if reward_processing_classes is not None and not isinstance(reward_processing_classes, list):
            reward_processing_classes = [reward_processing_classes]
        super().__init__(model, ref_model=None, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers)
        finish_group_trainer(self)
        # TRL's public attributes after construction (beside the shared ones)
        self.reward_funcs = self.scorer.funcs  # callables and loaded reward models, in order
        self.reward_weights = self.scorer.weights
        self.loss_type = self.args.loss_type
        self.scale_rewards = self.args.scale_rewards
        self.num_iterations = self.args.num_iterations
        self.importance_sampling_level = self.args.importance_sampling_level
        self.multi_objective_aggregation = self.args.multi_objective_aggregation
        self.use_liger_kernel = False
        self.log_completions = self.args.log_completions
        self.num_completions_to_print = self.args.num_completions_to_print

    def _step_token_count(self) -> float:
        """Tokens in the loss over the whole step's batch (every rank, every micro-batch), divided by ranks x
        micro-batches: "dapo"'s denominator, so that after the base class divides each micro-batch's loss by
        gradient_accumulation_steps and ranks average gradients, the step's loss is sum(token terms) / tokens."""
        a = self.args
        batch = self._step_batch
        total = sum(min(c.num_sampled, a.max_length - 1) for group in batch.completions for c in group
                    if not (a.mask_truncated_completions and c.finish_reason == "length"))
        return total / (self.accelerator.num_processes * a.gradient_accumulation_steps)

    def compute_rollout_loss(self, model, groups, kept=None):
        a = self.args
        first = not kept  # the step's first pass over these groups
        t = policy_terms(sequence_terms(model, self.ref_model, groups, temperature=a.sampling_temperature,
                                        sampling_temperature=a.sampling_temperature, **self.packing()), groups)
        dev = t.seq.mask.device
        rewards = torch.tensor([[r if r is not None else float("nan") for r in g.rewards] for g in groups],
                               dtype=torch.float32, device=dev)
        rewards = torch.where(torch.isfinite(rewards), rewards, torch.nan)  # unscorable: out of the group's stats
        advantages, std_zero = grpo_advantages(rewards, a.scale_rewards)
        advantages = advantages.reshape(-1)
        mask = t.seq.mask
        if a.mask_truncated_completions:
            finished = torch.tensor([c.finish_reason != "length" for c in t.seq.completions], device=dev)
            mask = mask * finished[:, None].to(mask.dtype)
        old, mu = ratio_denominator(t, a.off_policy_correction, kept)
        loss, m = grpo_loss(t.seq.logps, old, advantages, mask, loss_type=a.loss_type, epsilon_low=a.epsilon,
                            epsilon_high=a.epsilon_high, delta=a.delta,
                            importance_sampling_level=a.importance_sampling_level, ref_logps=t.seq.ref_logps,
                            beta=a.beta, use_bias_correction_kl=a.use_bias_correction_kl, behaviour_logps=mu,
                            off_policy=a.off_policy_correction, is_cap=a.is_cap, is_floor=a.is_floor,
                            max_completion_length=a.max_new_tokens,
                            num_items=self._step_token_count() if a.loss_type in ("dapo", "cispo") else None,
                            sapo_temperature_pos=a.sapo_temperature_pos, sapo_temperature_neg=a.sapo_temperature_neg)
        metrics = {f"policy/{k}": float(v) for k, v in m.items()}
        metrics.update({k: float(v) for k, v in m.items() if k.startswith(("clip_ratio/", "cispo_clip_ratio"))})
        if "kl" in m:  # TRL logs it only when beta != 0
            metrics["kl"] = float(m["kl"])
        finite = rewards[torch.isfinite(rewards)]
        metrics["reward"] = finite.mean().item() if finite.numel() else 0.0
        metrics["reward_std"] = finite.std().item() if finite.numel() > 1 else 0.0
        metrics["frac_reward_zero_std"] = std_zero.float().mean().item()
        metrics.update(trl_metrics(self, t, count_tokens=first))
        # KL-shaped score as objective/rlhf_reward, as the other learners (score - beta * sum(log pi - log pi_ref))
        kl_seq = ((t.seq.logps.detach() - t.seq.ref_logps) * t.mask).sum(-1)
        metrics.update(common_metrics(t, t.scores - a.beta * kl_seq, a.beta))
        return loss, metrics
