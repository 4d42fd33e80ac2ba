"""A callback that ends training after a given optimizer step (the run's stop-and-resume tests)."""

from transformers import TrainerCallback


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True
