"""GPU packing for the local runner: with `jobs` k and `gpus_per_run` g, each running run gets its own g GPUs.

Guarantees:
- `plan_slots` refuses, before anything starts, k x g beyond the visible GPUs, naming both numbers and where the
  visible count came from (`GpuError`, a GridError: the sweep exits 2 with nothing started);
- the slots are disjoint: no GPU is in two slots, so two running runs never share a device;
- a `GpuPool` hands a free slot to each run it starts and takes it back when the run ends: at any time the runs
  holding slots hold different GPUs, and at most k slots exist. The run's `CUDA_VISIBLE_DEVICES` is its slot;
- g = 0 (the default) packs nothing: runs inherit the sweep's environment, as before packing existed.
Visible GPUs: `CUDA_VISIBLE_DEVICES` when set (its entries, in order), else the devices `nvidia-smi -L` lists,
else none. Nothing here imports torch.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from launch.sweeping.grid import GridError


class GpuError(GridError):
    """More GPUs asked for than are visible; the message names both numbers."""


def visible_gpus(env: dict | None = None) -> tuple[list[str], str]:
    """(the visible GPUs as CUDA_VISIBLE_DEVICES entries, where that came from)."""
    env = os.environ if env is None else env
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is not None:
        devices = [d.strip() for d in value.split(",") if d.strip()]
        # CUDA stops at the first invalid entry (e.g. -1): what follows is not visible either
        cut = next((i for i, d in enumerate(devices) if d.startswith("-")), len(devices))
        return devices[:cut], f"CUDA_VISIBLE_DEVICES={value}"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        lines = [ln for ln in out.splitlines() if ln.startswith("GPU ")]
        return [str(i) for i in range(len(lines))], "nvidia-smi -L"
    return [], "no CUDA_VISIBLE_DEVICES and no nvidia-smi"


def plan_slots(jobs: int, gpus_per_run: int, devices: list[str], source: str) -> list[str]:
    """The k disjoint CUDA_VISIBLE_DEVICES values for k = `jobs` runs of `gpus_per_run` GPUs each; [] when
    gpus_per_run is 0. Raises GpuError when k x g exceeds the visible GPUs."""
    if gpus_per_run < 0:
        raise GpuError(f"--gpus_per_run must be >= 0, got {gpus_per_run}")
    if gpus_per_run == 0:
        return []
    need = jobs * gpus_per_run
    if need > len(devices):
        raise GpuError(f"--jobs {jobs} x --gpus_per_run {gpus_per_run} = {need} GPUs, but {len(devices)} are "
                       f"visible ({source}); lower --jobs to {len(devices) // gpus_per_run} or less"
                       if len(devices) >= gpus_per_run else
                       f"--gpus_per_run {gpus_per_run}: only {len(devices)} GPU(s) are visible ({source})")
    return [",".join(devices[i * gpus_per_run:(i + 1) * gpus_per_run]) for i in range(jobs)]


class GpuPool:
    """The free slots of `plan_slots`: `take` one for a starting run, `give` it back when the run ends."""

    def __init__(self, slots: list[str]):
        self._free = list(slots)
        self._held: set[str] = set()

    def take(self) -> str:
        """A free slot (CUDA_VISIBLE_DEVICES value). The caller starts at most as many runs as there are slots."""
        if not self._free:
            raise RuntimeError("no free GPU slot: more runs started than --jobs")
        slot = self._free.pop(0)
        self._held.add(slot)
        return slot

    def give(self, slot: str) -> None:
        self._held.remove(slot)
        self._free.append(slot)
