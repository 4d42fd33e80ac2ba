"""Optimizer steps whose loss or gradient norm is NaN/inf: skipped, counted, and fatal after too many in a row.

Where it hooks in: the Trainer computes the step's gradient norm (clipping first when `max_grad_norm > 0`) right
before `optimizer.step()`; `AsyncTrainerBase._get_grad_norm` hands that norm to `NonFiniteGuard.check_step`, which
also knows whether any micro-batch loss of the step was non-finite (`note_loss`). The decision is reduced over the
learner ranks, so every rank skips the same steps (a rank that stepped alone would leave the replicas apart).

What "skipped" means: every gradient is dropped (`grad = None`), so `optimizer.step()` leaves each parameter and its
optimizer state untouched (torch optimizers skip parameters without a gradient; weight decay included). The step
still counts: `global_step`, the policy version and the learning-rate schedule advance (the generators then receive
unchanged weights under the next version), which keeps every rank, the pipeline and checkpoints in step.

Under DeepSpeed the engine steps inside `accelerator.backward`, before the Trainer asks for the norm (the norm it
reports is the engine's, from that step): a non-finite step is counted and ends the run after the limit, but its
update is only avoided by DeepSpeed itself, i.e. by fp16's dynamic loss scaler, not with bf16 or fp32.
"""

from __future__ import annotations

import math

import torch


class NonFiniteSteps(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    def __init__(self, limit: int, accelerator, field_name: str = "max_nonfinite_steps"):
        self.limit = limit  # non-finite steps in a row that are skipped; one more raises
        self.accelerator = accelerator
        self.field_name = field_name
        self.total = 0  # steps skipped in this process's run (learner/nonfinite_steps)
        self.in_a_row = 0
        self.skipped_last = False  # the latest step was skipped (read by after_optimizer_step hooks)
        self._loss_bad = False

    def note_loss(self, loss: torch.Tensor) -> None:
        """Record one micro-batch loss of the current step."""
        self._loss_bad = self._loss_bad or not bool(torch.isfinite(loss.detach()).all())

    def check_step(self, grad_norm, model: torch.nn.Module, optimizer) -> bool:
        """Call once per optimizer step, after clipping and before `optimizer.step()`. Returns True when the step
        is skipped (its gradients dropped); raises `NonFiniteSteps` after more than `limit` in a row."""
        norm_bad = grad_norm is not None and not math.isfinite(float(grad_norm))
        flag = torch.tensor([float(self._loss_bad or norm_bad)], device=self.accelerator.device)
        self._loss_bad = False
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        self.skipped_last = bool(flag.item())
        if not self.skipped_last:
            self.in_a_row = 0
            return False
        self.total += 1
        self.in_a_row += 1
        model.zero_grad(set_to_none=True)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        if self.in_a_row > self.limit:
            raise NonFiniteSteps(
                f"learner: {self.in_a_row} optimizer steps in a row had a non-finite loss or gradient norm (last "
                f"gradient norm: {float(grad_norm) if grad_norm is not None else 'unknown'}), more than "
                f"{self.field_name}={self.limit}; lower the learning rate, check the rewards and the loss inputs, "
                f"or raise {self.field_name}")
        return True
