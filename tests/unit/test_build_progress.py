"""The first run builds the built-in task for minutes: rank 0 shows what is being built and how far it is (a line,
then one progress bar per stage); other ranks stay quiet. Runs `build_into` with tiny settings (seconds)."""

from __future__ import annotations

import pytest

from async_rlhf.tasks import build_builtin as prepare

TINY_SFT = prepare.SFTSettings(num_examples=64, steps=3, batch_size=8, hidden_size=32, num_layers=1, num_heads=1)
TINY_RM = prepare.RewardModelSettings(num_pairs=16, num_eval_pairs=8, max_new_tokens=4, batch_size=4)


def _build(tmp_path, monkeypatch):
    # evaluate_policy's 256 prompts are the slow part here: evaluate 8 instead
    real = prepare.evaluate_policy
    monkeypatch.setattr(prepare, "evaluate_policy", lambda *a, **k: real(*a, **{**k, "num_prompts": 8}))
    prepare.build_into(str(tmp_path / "cache"), seed=0, sft=TINY_SFT, reward=TINY_RM)


@pytest.mark.parametrize("rank", ["0", None])
def test_rank_0_shows_each_stage_with_its_progress(tmp_path, monkeypatch, capfd, rank):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    _build(tmp_path, monkeypatch)
    err = capfd.readouterr().err
    for stage in ("[1/4] training the SFT policy", "[2/4] evaluating the SFT policy",
                  "[3/4] sampling preference pairs", "[4/4] training the reward model"):
        assert stage in err, f"{stage!r} not shown:\n{err}"
    assert "3/3" in err and "24/24" in err  # SFT steps and pair prompts, counted to the end


def test_other_ranks_show_nothing(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("RANK", "1")
    _build(tmp_path, monkeypatch)
    assert "built-in task" not in capfd.readouterr().err
