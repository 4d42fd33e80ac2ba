"""The Trainer-side plumbing of `AsyncTrainerBase`: the dataloader's tickets and the callback that drives the pipeline.

The Trainer's dataloader yields one ticket per micro-batch (`StepTickets`; the data comes from the pipeline), and
`PipelineHooks` runs after every optimizer step: the algorithm's own hook, the batch's further passes
(`num_iterations`), the weight sync to the generators, the stop check after SIGTERM / SIGINT; it also writes each log
line to `metrics.jsonl` on rank 0.
"""

from __future__ import annotations

import json
import os
import time

import torch
from transformers import TrainerCallback


class StepTickets(torch.utils.data.Dataset):
    """One item per micro-batch; the real data comes from the pipeline."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class PipelineHooks(TrainerCallback):
    def __init__(self, trainer):  # an AsyncTrainerBase
        self.trainer = trainer
        self._t0 = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.timeline.mark("first_step")
        self.trainer.after_optimizer_step()
        self.trainer.further_passes()  # num_iterations > 1: the batch's later passes, each an optimizer step
        self.trainer.pipeline.after_optimizer_step(self.trainer.model, state.global_step)
        if self.trainer.stop_requested():  # SIGTERM / SIGINT: checkpoint this step, then stop
            control.should_save = True
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs is not None:
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
                # elapsed_seconds: since this process's train() began (a resumed run starts again from 0)
                record = {"step": state.global_step, "elapsed_seconds": round(time.perf_counter() - self._t0, 3)}
                f.write(json.dumps({**record, **logs}) + "\n")


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
