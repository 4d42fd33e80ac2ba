"""The "ipc" weight transport: a generator on learner rank 0's own GPU maps the new weights, nothing is copied.

Colocated mode (`colocate=True`, one GPU shared by the learner and its generator). Rank 0 keeps a device copy of
each published version (`gather_full_state(..., device=<its GPU>)`: taken before the optimizer steps again, so the
generator never sees half-updated live parameters) and sends, per tensor, the CUDA IPC handle that
`torch.multiprocessing.reductions.reduce_tensor` makes, keyed by the GPU's UUID. That is the wire format of vLLM
0.32's own `ipc` weight-transfer engine (`IPCWeightTransferUpdateInfo`: `names`, `dtype_names`, `shapes`,
`ipc_handles`, unpacked), so a vLLM generator loads it with `LLM.update_weights` (`generation/engine/vllm_backend.py`) and
the transformers backend rebuilds the same handles (`generation/engine/hf_backend.py`). A receiver in a process with other
visible devices replaces the handle's device index with its own for that UUID, as vLLM's engine does.

We build the handles ourselves rather than through vLLM's `IPCTrainerWeightTransferEngine`: that engine all-gathers
handles over the default process group, which would deadlock with several learner ranks when only rank 0 publishes,
and it frees its references when `send_weights` returns, while our generator loads later (its inbox is FIFO).

Lifetime: a version's device copy stays until `release(v)` says every generator has loaded `v` or newer (the
pipeline calls it after each publish), so at most the loaded version and the queued ones are held: with
`max_staleness` S, up to S + 2 copies of the policy on the GPU (count them in `vllm_gpu_memory_utilization`).
CUDA only; the CPU path of colocated mode is the shm transport.
"""

from __future__ import annotations

import torch

from async_rlhf.errors import WeightTransportError
from async_rlhf.types import WeightUpdate
from async_rlhf.weight_sync.transport import WholeStates


def gpu_uuid(device_index: int) -> str:
    return str(torch.cuda.get_device_properties(device_index).uuid)


def rebuild(handles: dict[str, tuple], device_index: int) -> torch.Tensor:
    """The tensor one `ipc_handles` entry names, mapped on this process's device `device_index`."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuid = gpu_uuid(device_index)
    if uuid not in handles:
        raise ValueError(f"weight update for GPU(s) {sorted(handles)}, but this generator runs on GPU {uuid}: the "
                         "'ipc' transport only reaches a generator on learner rank 0's own GPU")
    args = list(handles[uuid])
    args[6] = device_index  # reduce_tensor's args: index 6 is the producer's device index
    return rebuild_cuda_tensor(*args)


class IpcWeightTransport(WholeStates):
    name = "ipc"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise WeightTransportError(f"the 'ipc' weight transport needs a CUDA learner device, got {device}")
        self.device = device
        self._uuid = gpu_uuid(device.index if device.index is not None else torch.cuda.current_device())
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        self._published_bytes = 0

    def publish(self, state: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        from torch.multiprocessing.reductions import reduce_tensor

        tensors = {}
        for name, t in state.items():
            if t.device.type != "cuda":
                raise WeightTransportError(f"publish: {name} is on {t.device}; the 'ipc' transport shares device "
                                           "memory (gather the state with device=<the learner's GPU>)")
            tensors[name] = t.detach().contiguous()
        handles = [{self._uuid: reduce_tensor(t)[1]} for t in tensors.values()]
        self._held[version] = tensors
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._published_bytes += num_bytes
        return WeightUpdate(version=version, transport="ipc", names=list(tensors), num_bytes=num_bytes,
                            dtypes=[str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                            shapes=[list(t.shape) for t in tensors.values()], ipc_handles=handles)

    def release(self, version: int) -> None:
        for v in [v for v in self._held if v < version]:
            del self._held[v]
        torch.cuda.ipc_collect()

    def stats(self) -> dict[str, float]:
        return {"sync/ipc_held_versions": float(len(self._held))}

    def close(self) -> None:
        self._held.clear()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
