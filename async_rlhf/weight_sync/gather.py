"""Collecting the full policy weights on learner rank 0.

Called on every learner rank (it is a collective when parameters are sharded). Returns an ordered dict of CPU
tensors with the unwrapped model's `state_dict` names on rank 0 and None elsewhere. The copy is taken
synchronously, before the optimizer steps again: live parameters are never handed to another thread or process.

Under DeepSpeed ZeRO-3 each parameter is gathered one at a time (`GatheredParameters` per tensor), so the full
model is never materialised twice on a rank.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def _is_zero3(model) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


def gather_full_state(model: torch.nn.Module, is_main: bool) -> "OrderedDict[str, torch.Tensor] | None":
    if _is_zero3(model):
        import deepspeed

        out: OrderedDict[str, torch.Tensor] | None = OrderedDict() if is_main else None
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if out is not None:
                    out[name] = param.detach().to("cpu", copy=True)
        if out is not None:
            for name, buf in model.named_buffers():
                if name in model.state_dict():
                    out[name] = buf.detach().to("cpu", copy=True)
        return out
    if not is_main:
        return None
    return OrderedDict((k, v.detach().to("cpu", copy=True)) for k, v in model.state_dict().items())
