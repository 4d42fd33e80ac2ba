"""Weights through shared memory: one safetensors file per version in a RAM-backed directory (/dev/shm).

Never the disk, never a pickle on a pipe. The file is written under a temporary name and renamed, so a
generator can never read a half-written version. Files of versions that every generator has acknowledged
(and that are no longer the newest) are deleted by `release`; `close` removes the directory. The directory is an
`OwnedDir` (`shm_dirs.py`): locked for the transport's lifetime, so a run killed with SIGKILL leaves one that the
next transport (or init copy) created in any container sharing this `shm_dir` removes, and a live run's never is.

`publish` refuses to start a file that would not fit (RAM-backed directories that fill up also starve every other
user of /dev/shm, NCCL and vLLM included) and removes a partial one; either way it raises `OSError`, which the
pipeline turns into the run's failure path (`RolloutPipeline.after_optimizer_step`).
"""

from __future__ import annotations

import errno
import os
import shutil

import torch
from safetensors.torch import save_file

from async_rlhf.types import WeightUpdate
from async_rlhf.weight_sync.shm_dirs import WEIGHTS_PREFIX, OwnedDir, remove_orphaned_dirs
from async_rlhf.weight_sync.transport import WholeStates

PREFIX = WEIGHTS_PREFIX
SPACE_MARGIN = 1 << 20  # bytes left free beyond the file (safetensors header and rounding)

__all__ = ["ShmWeightTransport", "remove_orphaned_dirs"]


class ShmWeightTransport(WholeStates):
    """`weight_sync.transport.WeightTransport` over safetensors files in a RAM-backed directory."""

    name = "shm"
    device = "cpu"

    def __init__(self, shm_dir: str = "/dev/shm"):
        if not os.path.isdir(shm_dir):
            raise FileNotFoundError(f"shm_dir: {shm_dir!r} does not exist (set shm_dir to a RAM-backed directory)")
        remove_orphaned_dirs(shm_dir)
        self._owned = OwnedDir(shm_dir, PREFIX)
        self.dir = self._owned.path

    def publish(self, state: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        path = os.path.join(self.dir, f"policy-v{version}.safetensors")
        tmp = path + ".tmp"
        contiguous = {k: v.contiguous() for k, v in state.items()}
        num_bytes = sum(v.numel() * v.element_size() for v in contiguous.values())
        free = shutil.disk_usage(self.dir).free
        if num_bytes + SPACE_MARGIN > free:
            raise OSError(errno.ENOSPC, f"weights v{version} need {num_bytes / 2**30:.2f} GiB and {self.dir} has "
                                        f"{free / 2**30:.2f} GiB free", self.dir)
        try:
            save_file(contiguous, tmp)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
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
        self._owned.close()
