"""Periodic evaluations are off the training clock: the run summary reports their seconds as `eval_seconds`, its
`loop_seconds` and `train_seconds` are net of them, the console's time line names them, and every evaluation's
seconds are logged (`eval/seconds` in metrics.jsonl)."""

from __future__ import annotations

import json
import time

import pytest

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.tasks.setup import add_periodic_evaluation
from async_rlhf.trainers.run_summary import format_summary

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

EVAL_SECONDS = 1.5  # each evaluation's work: far longer than a tiny step, so an evaluation left on the clock shows


def test_periodic_evaluations_are_reported_apart_from_training(tmp_path, tiny_model_dir, tiny_run_config):
    evaluated = []

    def evaluate(model):  # stands in for a gold evaluation: a fixed amount of work on the policy
        time.sleep(EVAL_SECONDS)
        evaluated.append(model)
        return {"score": 0.5}

    steps = 4
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward,
                                    args=tiny_run_config(tmp_path, max_steps=steps), train_dataset=toy_prompts(32))
    add_periodic_evaluation(trainer, evaluate, every=1)
    t0 = time.perf_counter()
    trainer.train()
    outside = time.perf_counter() - t0
    s = trainer.run_summary
    assert len(evaluated) == steps  # once per step
    assert s["eval_seconds"] >= steps * EVAL_SECONDS
    # net of the evaluations: the loop (and the learner's training time within it) fits in what train() took
    # besides them, which it could not if the evaluations were still counted in it
    assert s["loop_seconds"] + s["eval_seconds"] <= outside
    assert s["train_seconds"] <= s["loop_seconds"]
    assert f"evaluating {s['eval_seconds']:.1f}s (not in training)" in format_summary(s)
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    seconds = [m["eval/seconds"] for m in logged if "eval/seconds" in m]
    assert len(seconds) == steps and all(x >= EVAL_SECONDS for x in seconds)
    assert sum(seconds) <= s["eval_seconds"] + 1e-6
    assert json.loads((tmp_path / "run_summary.json").read_text())["eval_seconds"] == s["eval_seconds"]
