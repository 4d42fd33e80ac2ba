"""Where generators run and what they start from, decided on the learner before any generator starts.

- `check_generator_devices`: the devices named for generators (`AsyncRLConfig.generator_device_fields`) exist and
  no learner rank uses them unless `colocate` says so (checked before any model loads, so a typo costs seconds, not a
  model load).
- `check_context_length`: `max_length` (and vLLM's `vllm_max_model_len`) fit the policy's positions (checked from its
  config before any model loads: vLLM would otherwise refuse only once the generator's engine starts).
- `engine_kwargs`: the engine settings a generator backend is built with (dtype of the learner's policy; vLLM's
  context length, memory share, eager mode and tensor-parallel size).
- `check_shm_space`: the shm weight transport has room for two copies of the policy's weights (checked before the
  policy loads, from the size of its files).
- `initial_model_dir`: the directory every generator loads version 0 from: the policy's own directory when it has
  one, else a RAM copy written by rank 0 (a collective: every rank must call it under ZeRO-3). The copy is an
  `OwnedDir` (`weight_sync/shm_dirs.py`): locked while the run lives, removed by `train()` at the end, and by the
  next run in any container sharing `shm_dir` if this one is killed.
"""

from __future__ import annotations

import os
import shutil

import torch

from async_rlhf.config.base import AsyncRLConfig
from async_rlhf.errors import ConfigError
from async_rlhf.learner.peft_policy import savable_model
from async_rlhf.weight_sync import gather_full_state
from async_rlhf.weight_sync.shm_dirs import INIT_PREFIX, OwnedDir, remove_orphaned_dirs


def check_generator_devices(args: AsyncRLConfig) -> None:
    if args.generator_servers or args.generator_launcher == "ray":  # the servers' business, or Ray's placement
        return
    count = torch.cuda.device_count()
    fields = args.generator_device_fields()
    for name, devices in fields.items():
        missing = [d for d in devices if d.startswith("cuda:") and int(d[5:]) >= count]
        if missing:
            valid = ["cpu"] + [f"cuda:{i}" for i in range(count)]
            raise ConfigError(f"{name}: {missing} not on this machine, which has {count} GPU(s); "
                              f"valid devices here: {valid}")
    if args.device.type != "cuda" or args.colocate:
        return
    learner = {f"cuda:{i}" for i in range(int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size)))}
    clash = sorted({d for devices in fields.values() for d in devices} & learner)
    if clash:
        raise ConfigError(f"generator_devices: {clash} are also used by learner ranks ({sorted(learner)}); give the "
                          "generators their own GPUs (e.g. launch learners on cuda:0-5 and generators on cuda:6,7), "
                          "or share them with --colocate true (one GPU: see README's topologies)")


def check_context_length(args: AsyncRLConfig, model_config) -> None:
    """Refuse a context the policy cannot hold: `max_length` is the learner's forward length (prompt + completion)
    and, unless `vllm_max_model_len` is set, vLLM's `max_model_len`; neither may exceed `max_position_embeddings`."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not positions:  # no learned or rotary position table to overrun
        return
    name = getattr(model_config, "_name_or_path", "") or "the policy"
    if args.max_length > positions:
        raise ConfigError(f"max_length: {args.max_length} is more than {name}'s max_position_embeddings {positions}; "
                          f"pass --max_length {positions} or less")
    if args.generator_backend != "transformers" and (args.vllm_max_model_len or 0) > positions:
        raise ConfigError(f"vllm_max_model_len: {args.vllm_max_model_len} is more than {name}'s "
                          f"max_position_embeddings {positions}; pass --vllm_max_model_len {positions} or less")


def check_shm_space(args: AsyncRLConfig, model_path: str | None) -> None:
    """Two copies of the weights must fit in `shm_dir`: the version generators load and the next one (older versions
    are deleted once every generator has moved on). Only known before loading when the policy is a local directory."""
    if not model_path or not os.path.isdir(model_path):
        return
    weights = sum(os.path.getsize(os.path.join(model_path, n)) for n in os.listdir(model_path)
                  if n.endswith((".safetensors", ".bin")))
    free = shutil.disk_usage(args.shm_dir).free
    if 2 * weights > free:
        raise ConfigError(f"shm_dir: {args.shm_dir!r} has {free / 2**30:.2f} GiB free; the shm weight transport needs "
                          f"about {2 * weights / 2**30:.2f} GiB (two copies of the {weights / 2**30:.2f} GiB of weights "
                          f"in {model_path}). Free space there or point shm_dir at a larger RAM-backed directory.")


def engine_kwargs(args: AsyncRLConfig, policy: torch.nn.Module | str, backend: str | None = None) -> dict:
    """`policy`: the learner's policy, or its dtype's name ('float32'); `backend`: default `args.generator_backend`."""
    dtype = policy if isinstance(policy, str) else str(next(policy.parameters()).dtype).replace("torch.", "")
    if (backend or args.generator_backend) != "vllm":  # and what an optional setting adds (`config/experimental.py`)
        return {"dtype": dtype, **args.generator_engine_options()}
    return {"dtype": dtype, "max_model_len": args.vllm_max_model_len or args.max_length,
            "gpu_memory_utilization": args.vllm_gpu_memory_utilization, "enforce_eager": args.vllm_enforce_eager,
            "tensor_parallel_size": args.vllm_tensor_parallel_size,
            "weight_transport": "ipc" if args.local_weight_transport == "ipc" else "shm",
            **({"speculative_config": config} if (config := args.vllm_speculative_config()) is not None else {})}


def initial_model_dir(source_path: str | None, model, tokenizer, accelerator,
                      shm_dir: str) -> tuple[str, OwnedDir | None]:
    """(directory, copy): `source_path` and None if it holds a saved model, else a RAM copy of `model`'s weights made
    on rank 0 (the caller closes it when the generators are gone). Other ranks get ("", None): only rank 0 starts
    generators."""
    if source_path and os.path.isfile(os.path.join(source_path, "config.json")):
        return source_path, None
    state = gather_full_state(model, accelerator.is_main_process)  # collective under ZeRO-3
    if not accelerator.is_main_process:
        return "", None
    remove_orphaned_dirs(shm_dir)
    copy = OwnedDir(shm_dir, INIT_PREFIX)
    try:
        # a LoRA policy: its base model, saved with the merged weights (`state` holds the base model's names)
        savable_model(accelerator.unwrap_model(model)).save_pretrained(copy.path, state_dict=state)
        tokenizer.save_pretrained(copy.path)
    except BaseException:
        copy.close()
        raise
    return copy.path, copy
