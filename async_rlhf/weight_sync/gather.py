"""Collecting the full policy weights on learner rank 0.

Called on every learner rank (it is a collective when parameters are sharded). Returns an ordered dict of CPU
tensors with the unwrapped model's `state_dict` names on rank 0 and None elsewhere. The copy is taken
synchronously, before the optimizer steps again: live parameters are never handed to another thread or process.

Under DeepSpeed ZeRO-3 every rank holds only its partition of each parameter. The parameters are gathered one at
a time (`GatheredParameters` on a single tensor: an all-gather into a temporary full tensor on every rank,
released when the block exits), and rank 0 copies each to CPU before the next is gathered. So no rank ever holds
more than its partitions plus one full parameter on the device, and rank 0 builds the CPU copy once, which is
what the transport publishes: the full model is never held twice. ZeRO-1/2 and DDP keep full parameters on every
rank; rank 0 copies its own.

A LoRA policy (`peft.PeftModel`) is sent as the plain model the generators hold: the base weights with the adapters
merged in, under the base model's names (`lora_merge.py`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from async_rlhf.weight_sync.lora_merge import is_peft_model, merged_state


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside DeepSpeed / DDP wrappers (their parameter names carry a `module.` prefix)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def is_zero3_partitioned(model: torch.nn.Module) -> bool:
    """True when the parameters are ZeRO-3 partitions (DeepSpeed tags each with a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def gather_full_state(model: torch.nn.Module, is_main: bool,
                      device: str | torch.device = "cpu") -> "OrderedDict[str, torch.Tensor] | None":
    """`device`: where rank 0's copy lives (the learner's GPU for the "ipc" transport)."""
    model = _unwrap(model)
    if not is_zero3_partitioned(model):
        if not is_main:
            return None
        if is_peft_model(model):
            return OrderedDict((k, v.to(device)) for k, v in merged_state(model).items())
        return OrderedDict((k, v.detach().to(device, copy=True)) for k, v in model.state_dict().items())

    import deepspeed

    out: OrderedDict[str, torch.Tensor] | None = OrderedDict() if is_main else None
    wanted = set(model.state_dict().keys())  # under ZeRO-3 its parameter entries are empty placeholders: cheap
    # same order on every rank, so the collectives line up; tied weights come once per name (the state_dict has both)
    for name, param in model.named_parameters(remove_duplicate=False):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if out is not None and name in wanted:
                out[name] = param.detach().to(device, copy=True)
    if out is not None:
        for name, buf in model.named_buffers():  # buffers are never partitioned
            if name in wanted:
                out[name] = buf.detach().to(device, copy=True)
        out = OrderedDict((k, out[k]) for k in model.state_dict().keys() if k in out)  # the state_dict's order
    return out
