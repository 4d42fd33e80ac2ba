"""The guessing task's build (`tasks/build_guess.py`) at a tiny setting, through the built-in task's cache code, and
its gold evaluation (`tasks/guess_evaluation.py`) on the saved policy directory, from Python and from its command
line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from async_rlhf.data import guess_task as g
from async_rlhf.tasks import build_guess, guess_evaluation
from async_rlhf.tasks.build_builtin import SFTSettings
from async_rlhf.tasks.guess_evaluation import main

TINY_SFT = SFTSettings(num_examples=32, steps=2, batch_size=8, hidden_size=16, num_layers=1, num_heads=1)


def test_tiny_build_is_cached_and_its_policy_evaluated(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path / "cache"))
    # an untrained policy rarely stops: a short episode budget keeps its evaluation to seconds
    monkeypatch.setattr(guess_evaluation, "MAX_COMPLETION_LENGTH", 24)
    paths = build_guess.prepare_guess(sft=TINY_SFT, eval_episodes=4)
    assert paths["cache_dir"] == str(tmp_path / "cache" / f"guess-v{g.TASK_VERSION}")
    manifest = json.loads(Path(paths["manifest"]).read_text())
    assert manifest["task"] == "guess" and manifest["sft_settings"]["steps"] == 2
    for env in ("guess", "control"):
        metrics = manifest["sft_eval"][env]
        assert metrics["episodes"] == 4 and 0 <= metrics["success_rate"] <= 1 and metrics["turns_mean"] >= 1
    assert not os.path.exists(paths["reward_model"])  # the environment's reward is exact: no reward model
    config = json.loads((Path(paths["sft_model"]) / "config.json").read_text())
    assert config["max_position_embeddings"] == build_guess.MAX_POSITIONS
    before = os.path.getmtime(paths["manifest"])
    assert build_guess.prepare_guess(sft=TINY_SFT) == paths and os.path.getmtime(paths["manifest"]) == before

    result = main(["--policy", paths["sft_model"], "--env", "control", "--episodes", "2", "--temperature", "0"])
    assert list(result) == ["control"] and result["control"]["episodes"] == 2
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{\n"):]) == result


def test_demonstrations_share_their_prompt_and_train_only_the_sampled_ids():
    tok = g.build_tokenizer()
    examples = build_guess.demonstrations(tok, 8, seed=0)
    shared = build_guess._shared_prompt_length(examples)
    for ids, labels in examples:
        trained = [t for t in labels if t != -100]
        turns = tok.decode(ids[shared:]).count("<|im_start|>assistant") + 1
        assert trained.count(tok.eos_token_id) == turns  # every assistant turn is trained to stop
        assert tok.decode(trained).count("<tool_call>") == tok.decode(ids).count("<tool_response>")
        assert "<tool_response>" not in tok.decode(trained)  # tool answers are context, not targets


def test_a_longer_trained_sft_policy_keeps_the_epochs_and_is_cached_beside_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path))
    default, longer = build_guess.sft_settings(0), build_guess.sft_settings(0, 1200)
    assert (default.steps, default.num_examples) == (600, 4096)
    assert (longer.steps, longer.num_examples) == (1200, 8192)  # twice the steps on twice the demonstrations
    assert build_guess.guess_cache_dir(0) == str(tmp_path / f"guess-v{g.TASK_VERSION}")
    assert build_guess.guess_cache_dir(0, 1200) == str(tmp_path / f"guess-v{g.TASK_VERSION}-sft1200")
