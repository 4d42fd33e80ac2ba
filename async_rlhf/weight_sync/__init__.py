"""Learner -> generator weight broadcast.

`gather.py` collects the full policy weights on learner rank 0 (collective on every rank, so that sharded
learners can take part); a transport publishes them and returns the `WeightUpdate` message that tells a
generator where to find them. Transports implement `transport.WeightTransport`: `shm.py` (RAM-backed safetensors, for
local generator processes and vLLM servers on the learners' host), `ipc.py` (CUDA IPC handles to rank 0's device copy,
for a generator colocated on its GPU) and `broadcast.py` (a torch.distributed group of its own, gloo on CPU and NCCL
on GPU; no longer used by the trainer, kept for benchmarks/weight_broadcast.py). `make_transport` picks one from the
configuration. `safetensors_io.py` reads the shm files (copying, or mapped);
`vllm_shm_engine.py` is the "async_rlhf_shm" backend of vLLM's own weight-transfer engine, which loads them into a
vLLM generator (it imports vLLM, so nothing here imports it).
"""

from async_rlhf.weight_sync.gather import gather_full_state
from async_rlhf.weight_sync.shm import ShmWeightTransport

__all__ = ["gather_full_state", "make_transport", "ShmWeightTransport"]


def make_transport(args, device):
    """The transport for local generator processes (`args.local_weight_transport`); `device`: learner rank 0's."""
    if args.local_weight_transport == "ipc":
        from async_rlhf.weight_sync.ipc import IpcWeightTransport

        return IpcWeightTransport(device)
    return ShmWeightTransport(args.shm_dir)
