"""The weight-transport boundary: how learner rank 0 hands a new policy to its generators.

`publish(state, version)` takes the gathered full state dict (CPU tensors nobody else mutates) and returns the
`WeightUpdate` message that tells a generator where to find it; the pool sends that message in FIFO order with
the generation requests. It raises `OSError` or `WeightTransportError` when the version cannot be delivered (the
pipeline turns either into the run's failure path). `release(version)` says every generator has loaded `version` or newer, so anything older
may be freed. `stats()` gives the transport's own metrics (stage-named, e.g. `sync/broadcast_seconds`); `close()`
frees everything the transport holds and is idempotent. `device` is where `publish` wants the state gathered (CPU,
but the learner's GPU for CUDA IPC); `network_only()` answers whether every update goes over the network (no
generator needs a file of the whole state), and only such a transport can `use_partitions` (ZeRO-3 learners keep
their own partitions instead of gathering, `partitions.py`).

Implementations: `shm.ShmWeightTransport` (RAM-backed files on this machine, for generator processes and for vLLM
servers, which load them through vLLM's weight routes) and `broadcast.BroadcastWeightTransport` (a torch.distributed
group; no longer used by the trainer, kept for benchmarks/weight_broadcast.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from async_rlhf.types import WeightUpdate


class WeightTransport(Protocol):
    name: str
    device: str | torch.device

    def network_only(self) -> bool: ...

    def use_partitions(self, store) -> None: ...  # a `partitions.PartitionStore`; refused unless network_only()

    def publish(self, state: dict[str, torch.Tensor], version: int) -> WeightUpdate: ...

    def release(self, version: int) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class WholeStates:
    """What a transport that needs each version's whole state answers (`shm`, `ipc`): not network-only, no
    partitions."""

    def network_only(self) -> bool:
        return False

    def use_partitions(self, store) -> None:
        raise ValueError(f"the {self.name!r} weight transport needs each version's whole state; partitions are only for "
                         "generators that all take the network")
