"""The run's stop-and-resume tests: a callback that ends training after a given optimizer step, and the check that
a stopped-and-resumed run trains loss for loss like an uninterrupted one."""

from __future__ import annotations

import json

import pytest
from transformers import TrainerCallback


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def losses(out) -> dict[int, float]:
    """Step -> loss, from a run's metrics.jsonl."""
    return {m["step"]: m["loss"] for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in m}


def check_resume_matches(make_trainer, tmp_path, steps: int, stop: int) -> None:
    """`make_trainer(output_dir)`: a trainer of `steps` steps saving a checkpoint every `stop` steps. Trains one run
    uninterrupted and one stopped after step `stop`, then resumed in the same directory; their losses must be equal
    step for step."""
    make_trainer(tmp_path / "full").train()
    first = make_trainer(tmp_path / "cut")
    first.add_callback(StopAt(stop))
    first.train()
    make_trainer(tmp_path / "cut").train(resume_from_checkpoint=True)
    want, got = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert sorted(got) == sorted(want) == list(range(1, steps + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, want, got)
