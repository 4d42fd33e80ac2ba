"""Learner -> generator weight broadcast.

`gather.py` collects the full policy weights on learner rank 0 (collective on every rank, so that sharded
learners can take part); a transport publishes them and returns the `WeightUpdate` message that tells a
generator where to find them. Transports implement `WeightTransport`: `shm.py` (RAM-backed safetensors, CPU)
and, on GPU, a torch.distributed/NCCL group (`nccl.py`).
"""

from async_rlhf.weight_sync.gather import gather_full_state
from async_rlhf.weight_sync.shm import ShmWeightTransport

__all__ = ["gather_full_state", "ShmWeightTransport"]
