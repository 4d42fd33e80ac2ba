"""Reading the weight files that `shm.ShmWeightTransport` writes: our own safetensors reader, in two flavours.

The format is an 8-byte little-endian header length, a JSON header ({name: dtype, shape, data_offsets}), then the
raw bytes (https://github.com/huggingface/safetensors, "Format"). Both readers yield `(name, tensor)` in name
order, which groups the tensors of one layer together (vLLM's layerwise reload processes a layer as soon as all
of its tensors have arrived, so this order keeps at most one layer's buffers alive).

- `iter_safetensors` reads each tensor into a fresh buffer (one copy out of the page cache). The tensors are
  independent of the file: what the transformers backend's `load_state_dict` needs.
- `map_safetensors` maps the whole file once (`torch.from_file`, MAP_PRIVATE: the learner's file can never be
  written through it) and yields views into the mapping: no copy at all, the bytes are read where they lie in
  /dev/shm when the consumer copies them. Only for consumers that copy what they are given (vLLM's weight
  loaders do) and drop the views afterwards; the mapping lives as long as any view does, and stays valid if the
  learner deletes the file meanwhile.

Why not safetensors' own `safe_open(...).get_tensor`: safetensors 0.8 leaves two Python objects behind per tensor
read, so a generator reloading weights every step grew without bound (benchmarks/soak.py;
tests/unit/weight_sync/test_weight_file_reader.py measures both readers).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import torch

# safetensors dtype codes
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """({name: {"dtype", "shape", "data_offsets"}}, offset of the first data byte). Reads the header only."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` in name order, each tensor read into its own buffer, one in memory at a time."""
    header, start = read_header(path)
    with open(path, "rb") as f:
        for name in sorted(header):
            info = header[name]
            begin, end = info["data_offsets"]
            data = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(start + begin)
            if f.readinto(data.numpy()) != end - begin:
                raise ValueError(f"{path}: tensor {name!r} is truncated")
            yield name, data.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def map_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, view)` in name order: read-only-by-convention views into one private mapping of the file."""
    header, start = read_header(path)
    size = os.path.getsize(path)
    mapped = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    for name in sorted(header):
        info = header[name]
        begin, end = info["data_offsets"]
        if start + end > size:
            raise ValueError(f"{path}: tensor {name!r} is truncated")
        raw = mapped[start + begin : start + end]
        dtype = DTYPES[info["dtype"]]
        if (start + begin) % dtype.itemsize:  # safetensors aligns its tensors; a hand-made file might not
            raw = raw.clone()
        yield name, raw.view(dtype).reshape(info["shape"])


def state_from_model_dir(path: str) -> dict[str, torch.Tensor]:
    """The state dict a learner would gather, read from a saved model directory (safetensors, one file or shards).

    Used to push the starting weights (version 0, or a checkpoint's) to generators that did not start from this
    directory. `save_pretrained` leaves out tied copies (e.g. `lm_head.weight` when tied to the embeddings); they
    are filled back in from the tensor they share storage with in the model's own `state_dict()`, built on the meta
    device from the config, so the names match what `gather_full_state` sends."""
    import json
    import os

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    index = os.path.join(path, "model.safetensors.index.json")  # only the policy's files: a checkpoint may hold others
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    else:
        files = [os.path.join(path, "model.safetensors")]
    if not all(os.path.isfile(file) for file in files):
        raise FileNotFoundError(f"{path}: no model.safetensors (or index) to send to the generators (save the "
                                "model with safetensors, or consolidate a sharded DeepSpeed checkpoint first)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    reference = model.state_dict(keep_vars=True)
    by_identity = {id(t): n for n, t in reference.items() if n in state}
    ordered = {}
    for name, tensor in reference.items():
        if name in state:
            ordered[name] = state[name]
        elif id(tensor) in by_identity:
            ordered[name] = state[by_identity[id(tensor)]]
        else:
            raise ValueError(f"{path}: weight {name!r} is missing from the safetensors files")
    return ordered
