"""What our generators add to every vLLM worker: the `async_rlhf_shm` weight-transfer backend, and the methods of
the "broadcast" transport.

vLLM builds its worker class from `worker_extension_cls` (a qualified name, because the worker may live in another
process), importing this module in the worker before it loads the model. Importing it also makes speculative
decoding exact on vLLM's CPU build (`spec_decode_cpu.py`). Importing it registers our
weight-transfer backend (`weight_sync/vllm_shm_engine.py`) with vLLM's factories in that process, which is what
lets `LLM(weight_transfer_config={"backend": "async_rlhf_shm"})` build it there; the "shm" transport goes through
vLLM's native `start_weight_update` / `update_weights` / `finish_weight_update` with it.

The methods below are added to the worker class and called with `llm.collective_rpc`. They run inside the worker,
next to the model, so only a few names cross the process boundary, never tensors. For the "broadcast" transport
the worker itself is a member of learner rank 0's weight group (`weight_sync/broadcast.py`) and receives each
tensor straight into its own memory (the GPU, with NCCL), feeding `reload_weights` one tensor at a time as it
arrives. (Method names must not collide with the worker's own: vLLM asserts it, hence no `update_weights` here.)

Why vLLM's layerwise reload (`reload_weights`, and the engine's start/finish) and not `model.load_weights`:
after the first load, vLLM's CPU build post-processes some layers (the linear weights are repacked for its kernels
and lose their `weight_loader`), so a second `model.load_weights` fails with `'Parameter' object has no attribute
'weight_loader'`. The layerwise reload restores each layer's checkpoint-format parameters, loads the HF-named
tensors (fusing q/k/v and gate/up as at start-up), re-runs the post-processing and copies the result into the
tensors the kernels already point at. It works on CPU and GPU alike. Copying HF tensors straight into vLLM's
parameters would not: on CPU the linear kernels keep their own repacked copy of each weight. That reload, not
reading the file, is where a CPU weight sync spends its time (`benchmarks/weight_broadcast.py`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from async_rlhf.generation.engine import spec_decode_cpu
from async_rlhf.weight_sync import vllm_shm_engine  # noqa: F401  (registers the "async_rlhf_shm" backend)

# vLLM imports this module in `init_worker` right after its platform registered its kernel overrides: replace the
# CPU build's broken expand kernel, without which speculative sampling is not exact there (spec_decode_cpu.py).
spec_decode_cpu.install()


class WeightSyncExtension:
    """Mixed into vLLM's worker class (so `self` is the worker: `self.reload_weights`, `self.model_runner`)."""

    _weight_group = None

    def join_weight_group(self, info: dict) -> None:
        """Become rank `info["rank"]` + this worker's rank in the engine of the learner's broadcast group."""
        from async_rlhf.weight_sync.broadcast import GroupInfo, WeightGroup

        self.leave_weight_group()
        group = GroupInfo.from_dict(info)
        worker_rank = self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]
        self._weight_group = WeightGroup(group, rank=group.rank + worker_rank)

    def leave_weight_group(self) -> None:
        if self._weight_group is not None:
            self._weight_group.close()
            self._weight_group = None

    def load_broadcast_weights(self, version: int, names: list[str], dtypes: list[str],
                               shapes: list[list[int]]) -> int:
        """Receive every tensor of weights `version` from rank 0 and load it. Returns the count.

        Every announced tensor is received even if vLLM stopped asking early (it raises then): rank 0 broadcasts
        them all, and a member that skipped one would pair the next broadcast with the wrong buffer."""
        from async_rlhf.types import WeightUpdate
        from async_rlhf.weight_sync.broadcast import receive_weights

        if self._weight_group is None:
            raise RuntimeError("load_broadcast_weights before join_weight_group")
        update = WeightUpdate(version=version, transport="broadcast", names=names, dtypes=dtypes, shapes=shapes)
        received = receive_weights(self._weight_group, update)
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in received:
                count += 1
                yield name, tensor

        try:
            self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        finally:
            skipped = sum(1 for _ in received)  # keep the group in step whatever happened above
        if count != len(names):
            raise RuntimeError(f"weights v{version}: vLLM loaded {count} of {len(names)} tensors ({skipped} received "
                               "but never asked for)")
        return count
