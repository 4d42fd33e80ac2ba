"""Methods injected into every vLLM worker so the generator can swap weights with `llm.collective_rpc`.

vLLM builds its worker class from `worker_extension_cls` (a qualified name, because the worker may live in
another process) and adds these methods to it. They run inside the worker, next to the model, so only a
path or a few names cross the process boundary, never tensors. For the "broadcast" transport the worker itself is
a member of learner rank 0's weight group (`weight_sync/broadcast.py`) and receives each tensor straight into its
own memory (the GPU, with NCCL), feeding `reload_weights` one tensor at a time as it arrives.

Why `reload_weights` and not `model.load_weights`: after the first load, vLLM's CPU build post-processes
some layers (the linear weights are repacked for its kernels and lose their `weight_loader`), so a second
`model.load_weights` fails with `'Parameter' object has no attribute 'weight_loader'`. The worker's
`reload_weights` runs vLLM's layerwise reload: it restores each layer's checkpoint-format parameters, loads
the HF-named tensors (fusing q/k/v and gate/up as at start-up), re-runs the post-processing and copies the
result into the tensors the kernels already point at. It works on CPU and GPU alike. Copying HF tensors straight
into vLLM's parameters would not: on CPU the linear kernels keep their own repacked copy of each weight.

Cost (benchmarks/weight_load.py, 2 shared cores): a 100M-parameter fp32 model (416 MB) reloads in 0.25-0.45 s,
1-1.7 GB/s against 4.5-11 GB/s for a bare `copy_` of the same bytes; the time goes to the layerwise
re-processing, not to reading the file. Reading one tensor at a time (`iter_safetensors`) rather than `load_file`
takes about the same time but never holds a second full copy of the state dict.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator

import torch

# safetensors dtype codes (https://github.com/huggingface/safetensors, "Format")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` from a safetensors file, one tensor in memory at a time, in name order.

    The format is an 8-byte little-endian header length, a JSON header ({name: dtype, shape, data_offsets}),
    then the raw bytes; each tensor is read straight into a fresh buffer (on /dev/shm, one copy out of the page
    cache). Not `safe_open(...).get_tensor`: safetensors 0.8 leaves two Python objects behind per tensor read,
    so a generator reloading weights every step grew without bound (benchmarks/soak.py;
    tests/unit/test_weight_file_reader.py measures it).
    """
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name in sorted(header):
            info = header[name]
            begin, end = info["data_offsets"]
            data = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(8 + size + begin)
            if f.readinto(data.numpy()) != end - begin:
                raise ValueError(f"{path}: tensor {name!r} is truncated")
            yield name, data.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


class WeightSyncExtension:
    """Mixed into vLLM's worker class (so `self` is the worker: `self.reload_weights`, `self.model_runner`)."""

    _weight_group = None

    def load_safetensors_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` (HF names) into the model. Returns the count."""
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in iter_safetensors(path):
                count += 1
                yield name, tensor

        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return count

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
