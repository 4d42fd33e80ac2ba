"""Weights through shared memory: one safetensors file per version in a RAM-backed directory (/dev/shm).

Never the disk, never a pickle on a pipe. The file is written under a temporary name and renamed, so a
generator can never read a half-written version. Files of versions that every generator has acknowledged
(and that are no longer the newest) are deleted by `release`; `close` removes the directory. A run killed with
SIGKILL cannot clean up, so the directory name carries the owner's pid and the next transport created on the
machine removes directories whose owner is gone.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from async_rlhf.types import WeightUpdate

logger = logging.getLogger(__name__)
PREFIX = "async_rlhf-weights-"
_OWNED = re.compile(re.escape(PREFIX) + r"pid(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_orphaned_dirs(shm_dir: str) -> list[str]:
    """Remove weight directories left in `shm_dir` by runs whose process no longer exists; returns their paths."""
    removed = []
    for name in os.listdir(shm_dir):
        match = _OWNED.match(name)
        if match and not _pid_alive(int(match.group(1))):
            path = os.path.join(shm_dir, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d weight directories left by killed runs: %s", len(removed), removed)
    return removed


class ShmWeightTransport:
    """`weight_sync.transport.WeightTransport` over safetensors files in a RAM-backed directory."""

    name = "shm"

    def __init__(self, shm_dir: str = "/dev/shm"):
        if not os.path.isdir(shm_dir):
            raise FileNotFoundError(f"shm_dir: {shm_dir!r} does not exist (set shm_dir to a RAM-backed directory)")
        remove_orphaned_dirs(shm_dir)
        self.dir = tempfile.mkdtemp(prefix=f"{PREFIX}pid{os.getpid()}-", dir=shm_dir)

    def publish(self, state: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        path = os.path.join(self.dir, f"policy-v{version}.safetensors")
        tmp = path + ".tmp"
        contiguous = {k: v.contiguous() for k, v in state.items()}
        save_file(contiguous, tmp)
        os.replace(tmp, path)
        num_bytes = sum(v.numel() * v.element_size() for v in contiguous.values())
        return WeightUpdate(version=version, transport="shm", path=path, names=list(contiguous), num_bytes=num_bytes)

    def release(self, version: int) -> None:
        """Delete every file older than `version` (all generators have loaded `version` or newer)."""
        for name in os.listdir(self.dir):
            if name.startswith("policy-v") and name.endswith(".safetensors"):
                v = int(name[len("policy-v"):-len(".safetensors")])
                if v < version:
                    os.unlink(os.path.join(self.dir, name))

    def stats(self) -> dict[str, float]:
        return {}  # the write is on the learner's path: the pipeline's sync/transfer_seconds is its time

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
