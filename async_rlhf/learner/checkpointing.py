"""What a checkpoint adds to the Trainer's own files so the asynchronous pipeline resumes as if never stopped.

The Trainer saves the model, optimizer, scheduler, RNG states and `trainer_state.json` (global step = policy
version). We add `async_rlhf_pipeline.json`: the rollouts already generated but not yet trained (with their
versions), the counters, and the fields that must match on resume. Prompts need no state: the prompt of every
step is a pure function of (seed, step) (`PromptStream`), so batches that were in flight are regenerated
identically. Everything is JSON (nothing is unpickled); each file is written then renamed, and the completion
marker is written last, so a checkpoint killed half-way is never taken for a valid one. Saving into a directory
that already holds a complete checkpoint (a run resumed from an older one reaches the same step again) first removes
its marker (`begin_save`), and the new marker is made durable by an fsync of the directory.

Security: our files are JSON, but the Trainer's own loaders run on resume, and under DeepSpeed its checkpoint loader
unpickles (`torch.load` with full unpickling of the optimizer states). `check_resume_is_safe` warns about that and
refuses a checkpoint that another user could have written into (a group- or other-writable file or directory).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import stat

from async_rlhf.types import RolloutBatch
from async_rlhf.errors import CheckpointError

PIPELINE_FILE = "async_rlhf_pipeline.json"
COMPLETE_MARKER = "async_rlhf_complete.json"
FORMAT = 1
logger = logging.getLogger(__name__)


def _write_json(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, allow_nan=False)  # strict JSON: `from_dict` refuses NaN/inf on resume
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_pipeline_state(directory: str, version: int, pending: list[RolloutBatch], counters: dict,
                        identity: dict) -> None:
    _write_json(os.path.join(directory, PIPELINE_FILE), {
        "format": FORMAT, "version": version, "identity": identity, "counters": counters,
        "pending": [b.to_dict() for b in pending],
    })


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin_save(directory: str) -> None:
    """Before any file of a checkpoint is (re)written: a complete checkpoint being overwritten stops being complete."""
    marker = os.path.join(directory, COMPLETE_MARKER)
    if os.path.exists(marker):
        os.unlink(marker)
        _fsync_dir(directory)  # the removal reaches the disk before the first rewritten file does


def mark_complete(directory: str, version: int) -> None:
    _write_json(os.path.join(directory, COMPLETE_MARKER), {"format": FORMAT, "version": version})
    _fsync_dir(directory)  # the rename of the marker is durable: a crash now cannot lose it


def check_resume_is_safe(directory: str, unpickles: bool) -> None:
    """Refuse to resume from a checkpoint that users other than its owner could have modified, when resuming will
    unpickle (DeepSpeed's loader): unpickling runs whatever code such a user put there."""
    if not unpickles:
        return
    logger.warning("resuming from %s under DeepSpeed: DeepSpeed's checkpoint loader unpickles its files; resume only "
                   "from checkpoints you wrote", directory)
    for root, dirs, files in os.walk(directory):
        for path in [root] + [os.path.join(root, n) for n in files]:
            mode = os.lstat(path).st_mode
            if mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise CheckpointError(
                    f"resume_from_checkpoint: {path} is writable by {'others' if mode & stat.S_IWOTH else 'its group'} "
                    f"(mode {stat.filemode(mode)}), and DeepSpeed's loader unpickles this checkpoint; remove the "
                    f"write bit (chmod -R go-w {directory}) if you trust its contents")


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, COMPLETE_MARKER))


def identity(model_config, num_prompts: int, prompts_per_step: int, seed: int) -> dict:
    """What must match between a checkpoint and the run resuming from it."""
    c = model_config
    return {"model": f"{c.model_type}/vocab{c.vocab_size}/hidden{getattr(c, 'hidden_size', None)}"
                     f"/layers{getattr(c, 'num_hidden_layers', None)}",
            "num_prompts": num_prompts, "prompts_per_step": prompts_per_step, "seed": seed}


def resolve(resume_from_checkpoint, output_dir: str) -> str | None:
    """The checkpoint directory to resume from: None, a path, or True / "last-checkpoint" for the newest complete
    checkpoint in `output_dir` (an error if there is none)."""
    if resume_from_checkpoint in (None, False, ""):
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == "last-checkpoint":
        path = latest_complete_checkpoint(output_dir)
        if path is None:
            raise CheckpointError(f"resume_from_checkpoint: no complete checkpoint in {output_dir}")
        return path
    return str(resume_from_checkpoint)


def latest_complete_checkpoint(output_dir: str) -> str | None:
    found = []
    for path in glob.glob(os.path.join(output_dir, "checkpoint-*")):
        m = re.fullmatch(r"checkpoint-(\d+)", os.path.basename(path))
        if m and is_complete(path):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def load_pipeline_state(directory: str, identity: dict) -> dict:
    """Validate a checkpoint and return {"version", "pending": [RolloutBatch], "counters"}."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"resume_from_checkpoint: {directory} is not a directory")
    if not is_complete(directory):
        raise CheckpointError(f"resume_from_checkpoint: {directory} is incomplete (no {COMPLETE_MARKER}: the run "
                              "was stopped while saving it); resume from the previous checkpoint")
    path = os.path.join(directory, PIPELINE_FILE)
    try:
        with open(path) as f:
            state = json.load(f)
        pending = [RolloutBatch.from_dict(b) for b in state["pending"]]
        version = int(state["version"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"resume_from_checkpoint: {path} is unreadable or truncated: {exc}") from exc
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {state.get('format')} is not {FORMAT}")
    for key, value in identity.items():
        saved = state.get("identity", {}).get(key)
        if saved != value:
            raise CheckpointError(f"resume_from_checkpoint: {directory} was saved with {key}={saved!r}, this run "
                                  f"has {key}={value!r} (a checkpoint from a different model or dataset)")
    return {"version": version, "pending": pending, "counters": state.get("counters", {})}
