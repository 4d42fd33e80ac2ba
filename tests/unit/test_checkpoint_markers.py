"""Checkpoint completion markers and resume safety: re-saving over a complete checkpoint makes it incomplete until
the new save ends (a save that fails half-way leaves no complete-looking mix of old and new files), and a checkpoint
others could have written into is refused where resuming unpickles (DeepSpeed)."""

from __future__ import annotations

import os

import pytest
from datasets import Dataset

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.learner import checkpointing
from async_rlhf.learner.checkpointing import COMPLETE_MARKER, check_resume_is_safe, is_complete
from async_rlhf.errors import CheckpointError


def reward(prompts, completions, **kw):
    return [0.0] * len(completions)


def test_resaving_over_a_complete_checkpoint_that_fails_half_way_leaves_it_incomplete(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=reward,
                                    args=AsyncOnlineDPOConfig(output_dir=str(out), max_length=48, max_new_tokens=6,
                                                              generator_backend="transformers"),
                                    train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}))
    trainer.state.global_step = 2
    directory = out / "checkpoint-2"
    directory.mkdir(parents=True)
    checkpointing.mark_complete(str(directory), 2)  # a complete checkpoint-2 from an earlier run of this output_dir
    (directory / "model.safetensors").mkdir()  # the model file cannot be rewritten: the save fails half-way
    assert is_complete(str(directory))
    with pytest.raises(Exception, match="Is a directory"):
        trainer._save_checkpoint(trainer.model, trial=None)
    assert not is_complete(str(directory)), "a half-rewritten checkpoint still carries the old completion marker"


def test_begin_save_and_mark_complete(tmp_path):
    checkpointing.mark_complete(str(tmp_path), 5)
    assert is_complete(str(tmp_path))
    checkpointing.begin_save(str(tmp_path))
    assert not os.path.exists(tmp_path / COMPLETE_MARKER)
    checkpointing.begin_save(str(tmp_path))  # nothing to remove: fine


@pytest.mark.parametrize("target, mode, who", [("dir", 0o775, "its group"), ("file", 0o646, "others")])
def test_deepspeed_resume_refuses_a_checkpoint_others_can_write(tmp_path, caplog, target, mode, who):
    directory = tmp_path / "checkpoint-4"
    (directory / "global_step4").mkdir(parents=True, mode=0o755)
    directory.chmod(0o755)
    state = directory / "global_step4" / "mp_rank_00_model_states.pt"
    state.write_bytes(b"not really a pickle")
    state.chmod(0o644)
    check_resume_is_safe(str(directory), unpickles=True)  # owner-only writable: allowed, with a warning
    assert "DeepSpeed's checkpoint loader unpickles" in caplog.text
    path = directory / "global_step4" if target == "dir" else state
    path.chmod(mode)
    with pytest.raises(CheckpointError, match=rf"{path} is writable by {who} .*chmod -R go-w {directory}"):
        check_resume_is_safe(str(directory), unpickles=True)
    check_resume_is_safe(str(directory), unpickles=False)  # plain accelerate: JSON and weights-only loads
