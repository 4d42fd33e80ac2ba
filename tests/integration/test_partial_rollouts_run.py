"""Partial rollouts with real vLLM generators (weights loaded in flight), checked from the run's own records:

* every sample's oldest and newest token version within `step - max_staleness .. step`;
* each step trains exactly the groups its record names, and over the run every group of the prompt stream is trained
  exactly once (none twice, none lost), with the prompts the stream gives it;
* a run stopped at a checkpoint while groups were still generating and resumed: finished-but-untrained groups are
  trained from the checkpoint as they were (their version span predates the resume), unfinished ones regenerated;
* a generator killed mid-stream while groups are carried (slow): restarted, nothing lost or counted twice;
* `staleness_bound="newest"`: every sample's newest token within `step - max_staleness`, its oldest within
  `step - max_oldest_staleness`, every group still trained exactly once.

Prompts get lognormal completion budgets (`toy_prompts(lengths=...)`), so groups finish out of order and some are
carried across steps.
"""

from __future__ import annotations

import json
import signal

import pytest
from stop_at import StopAt
from transformers import TrainerCallback

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.learner.checkpointing import PIPELINE_FILE
from async_rlhf.pipeline.prompt_stream import PromptStream

pytest.importorskip("vllm")

P, STEPS, S = 4, 8, 1


def config(out, **kw):
    return AsyncOnlineDPOConfig(**{
        "output_dir": str(out), "max_steps": STEPS, "per_device_train_batch_size": P, "max_new_tokens": 48,
        "max_length": 80, "generator_backend": "vllm", "weight_load": "in_flight", "partial_rollouts": P,
        "max_staleness": S, "generator_threads": 1, "learning_rate": 1e-3, "disable_tqdm": True, "seed": 5,
        "generator_start_timeout": 180, "rollout_timeout": 120, **kw})


def data():
    return toy_prompts(64, seed=1, lengths=(10, 1.0, 48))


def final_records(out) -> dict[int, dict]:
    final = {}  # a step trained again after a resume replaces the record of the stopped run
    for line in (out / "trained_batches.jsonl").read_text().splitlines():
        r = json.loads(line)
        final[r["step"]] = r
    return final


def check_records(out, steps: int = STEPS, s_old: int = S) -> dict[int, dict]:
    """`s_old`: the cap on the oldest token (S under "oldest"; max_oldest_staleness under "newest")."""
    final = final_records(out)
    assert sorted(final) == list(range(steps))
    stream = PromptStream(64, P, 5)
    trained = []
    for step, r in final.items():
        assert len(r["groups"]) == len(r["prompt_ids"]) == P
        for (b, j), pid, samples, span in zip(r["groups"], r["prompt_ids"], r["sample_versions"], r["group_versions"]):
            assert pid == stream.prompts_for_step(b)[j]  # the prompt the stream gives that group
            for oldest, newest in samples:  # every sample, by its oldest and newest token
                assert step - s_old <= oldest <= newest <= step and newest >= step - S, (step, b, j, samples)
            assert span == [min(o for o, _ in samples), max(n for _, n in samples)]
        assert r["policy_version"] == min(span[0] for span in r["group_versions"])
        trained += [tuple(g) for g in r["groups"]]
    assert len(trained) == len(set(trained)), "a group trained twice"
    assert set(trained) == {divmod(k, P) for k in range(steps * P)}, "a group lost"
    return final


@pytest.mark.slow  # an experimental schedule (experimental/partial_rollouts.py); resume is default-tier in test_resume.py
def test_stopped_with_groups_in_flight_and_resumed_trains_every_group_once_within_the_bound(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    first = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=data(),
                                  args=config(out, save_strategy="steps", save_steps=4))
    first.add_callback(StopAt(4))
    first.train()
    saved = json.loads((out / "checkpoint-4" / PIPELINE_FILE).read_text())
    state = saved["counters"]["partial"]
    in_flight = {tuple(g[:2]) for g in state["open"]} - {(b["batch_id"], b["chunk"]) for b in saved["pending"]}
    assert in_flight, "no group was generating at the checkpoint"
    finished = {(b["batch_id"], b["chunk"]): b for b in saved["pending"]}

    resumed = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=data(),
                                    args=config(out, save_strategy="steps", save_steps=4))
    resumed.train(resume_from_checkpoint=True)
    final = check_records(out)
    where = {tuple(g): (step, r["group_versions"][i]) for step, r in final.items() for i, g in enumerate(r["groups"])}
    for key in in_flight:  # regenerated after the resume, with the checkpoint's weights or newer
        assert where[key][0] >= 4 and where[key][1][0] >= 4, (key, where[key])
    for key, b in finished.items():  # trained as saved (unless too stale by then: dropped and regenerated, counted)
        versions = [v for v, _ in b["completions"][0][0]["version_starts"]]
        assert where[key][0] >= 4
        assert where[key][1][0] == min(versions) or resumed.run_summary["partial_rollouts"]["dropped"] > 0
    # the run did carry groups: some step trained groups of a later batch before all of its own
    assert any(r["groups"] != [[step, j] for j in range(P)] for step, r in final.items())
    assert resumed.run_summary["partial_rollouts"]["carried"] + first.run_summary["partial_rollouts"]["carried"] > 0


class KillGenerator(TrainerCallback):
    def __init__(self, trainer, step):
        self.trainer, self.step = trainer, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            import os

            os.kill(self.trainer.pipeline.pool.processes[0].pid, signal.SIGKILL)


@pytest.mark.slow  # a third vLLM start (the restart); the pool's restart is tested in the default tier elsewhere
def test_generator_killed_mid_stream_with_carried_groups_loses_nothing(tmp_path, tiny_model_dir):
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=data(),
                                    args=config(tmp_path))
    trainer.add_callback(KillGenerator(trainer, 3))
    trainer.train()
    assert trainer.run_summary["generator_restarts"] == 1
    check_records(tmp_path)


@pytest.mark.slow  # an experimental schedule; both caps are checked on the pipeline's own queue in the unit tier
def test_newest_token_bound_trains_every_group_once_within_both_caps(tmp_path, tiny_model_dir):
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=data(),
                                    args=config(tmp_path, staleness_bound="newest", max_oldest_staleness=3))
    trainer.train()
    final = check_records(tmp_path, s_old=3)
    summary = trainer.run_summary
    assert summary["staleness_bound"] == "newest" and summary["max_oldest_staleness"] == 3
    behind = [step - r["policy_version"] for step, r in final.items()]
    assert sum(summary["staleness_histogram"].values()) == STEPS and max(behind) <= 3
