"""The sorting task's build (`tasks/build_sorting.py`) through the built-in task's cache code, with no proxy reward
model, and `--task sorting` as a recipe parses it: its defaults, its SFT policy, the gold reward, and an evaluation
that samples at temperature 1."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from async_rlhf.config import algorithms as c
from async_rlhf.config.cli import parse_args
from async_rlhf.data import sorting_task as st
from async_rlhf.tasks import build_builtin as prepare
from async_rlhf.tasks.build_sorting import MAX_POSITIONS, prepare_sorting
from async_rlhf.tasks.setup import ScriptArguments, setup_task, task_defaults

TINY_SFT = prepare.SFTSettings(num_examples=64, steps=3, batch_size=8, hidden_size=32, num_layers=1, num_heads=1)


def test_reduced_build_and_the_recipe_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path / "cache"))
    real = prepare.evaluate_policy
    seen = {}

    def few_prompts(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **{**kwargs, "num_prompts": 8})

    monkeypatch.setattr(prepare, "evaluate_policy", few_prompts)
    paths = prepare_sorting(sft=TINY_SFT)
    assert paths["cache_dir"] == str(tmp_path / "cache" / f"sorting-v{st.TASK_VERSION}")
    manifest = json.loads(Path(paths["manifest"]).read_text())
    assert manifest["task"] == "sorting" and manifest["reward_model"] is None
    assert not os.path.exists(paths["reward_model"])  # trained on the gold reward: no proxy model
    assert seen["max_new_tokens"] == st.MAX_NEW_TOKENS  # the SFT evaluation gives the longest answer room
    sft_config = json.loads((Path(paths["sft_model"]) / "config.json").read_text())
    assert sft_config["max_position_embeddings"] == MAX_POSITIONS
    assert prepare_sorting("small", sft=TINY_SFT)["cache_dir"].endswith(f"sorting-v{st.TASK_VERSION}-small")
    with pytest.raises(ValueError, match="'huge' is not one of small, default, large"):
        prepare_sorting("huge")

    script, config = parse_args((ScriptArguments, c.AsyncRLOOConfig),
                                ["--task", "sorting", "--eval_prompts", "4", "--output_dir", str(tmp_path / "out")],
                                task_defaults("rloo"))
    assert (config.max_new_tokens, config.max_length) == (st.MAX_NEW_TOKENS, 80)
    from async_rlhf.tasks import evaluation

    evaluated = {}
    real_policy_eval = evaluation.evaluate_policy
    monkeypatch.setattr(evaluation, "evaluate_policy",
                        lambda *a, **k: evaluated.update(k) or real_policy_eval(*a, **k))
    task = setup_task(script, config)
    assert task.model == paths["sft_model"] and task.reward is st.gold_reward
    assert task.train_dataset["prompt"][:4] == st.make_split(4, 0, "train")["prompt"]
    results = task.evaluate(paths["sft_model"])
    assert results["num_prompts"] == 4 and results["kl"] == pytest.approx(0.0, abs=1e-4)
    assert 0 <= results["gold_reward"] <= 2 and results["reference_gold_reward"] == 2.0
    assert evaluated["temperature"] == 1.0  # sampled: greedily the SFT policy leaves nothing to measure


def test_a_rebuild_on_the_same_machine_is_the_same_policy(tmp_path, monkeypatch):
    """A cache that is gone is rebuilt to the same bytes (seeded, the machine's thread count): records made before and
    after agree. Another thread count or other build code makes another policy, which a run's `initial_policy`
    tells apart (trainers/provenance.py)."""
    from async_rlhf.trainers.provenance import fingerprint

    real = prepare.evaluate_policy
    monkeypatch.setattr(prepare, "evaluate_policy", lambda *a, **k: real(*a, **{**k, "num_prompts": 4}))
    builds = [prepare_sorting(cache_dir=str(tmp_path / name), sft=TINY_SFT)["sft_model"] for name in ("a", "b")]
    assert fingerprint(builds[0]) == fingerprint(builds[1])
