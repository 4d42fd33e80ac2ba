"""Gold evaluation during training: every `every` optimizer steps, rank 0 evaluates the learner's current weights.

The task's evaluation function (for the built-in task: gold win-rate, gold reward, KL and SFT perplexity, see
`tasks/evaluation.py`) runs on the in-memory policy, so no checkpoint is written for it. Results are logged with the
training log of that same step under `eval/<metric>` (metrics.jsonl, report_to integrations; every rank asks the
Trainer to log at that step, because logging reduces metrics across ranks), which is what the sweep's "win-rate
over training steps" plot reads. Other ranks do not wait for it except at their next collective.
"""

from __future__ import annotations

import logging
import math

from transformers import TrainerCallback

from async_rlhf.learner.peft_policy import forward_model

logger = logging.getLogger(__name__)


class PeriodicEvaluation(TrainerCallback):
    def __init__(self, trainer, evaluate, every: int):
        if every < 0:
            raise ValueError(f"gold_eval_steps: must be >= 0, got {every}")
        self.trainer = trainer
        self.evaluate = evaluate
        self.every = every
        self._warned = False

    def on_step_end(self, args, state, control, **kwargs):
        if not self.every or state.global_step % self.every:
            return
        control.should_log = True  # on every rank: the results belong to this step's log
        if not state.is_world_process_zero:
            return
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        if any(hasattr(p, "ds_id") for p in model.parameters()):  # ZeRO-3: rank 0 does not hold the whole model
            if not self._warned:
                logger.warning("gold evaluation during training is skipped under ZeRO-3; the final one still runs")
                self._warned = True
            return
        was_training = model.training
        try:
            results = self.evaluate(forward_model(model))  # a LoRA policy: its base model, adapters in place
        finally:
            model.train(was_training)
        self.trainer.extra_logs.update({f"eval/{k}": float(v) for k, v in results.items()
                                        if isinstance(v, (int, float)) and not math.isnan(float(v))})
