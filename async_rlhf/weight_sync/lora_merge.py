"""The weights a generator needs from a LoRA policy: the base model's weights with the adapters merged in, under the
base model's own parameter names.

A generator (vLLM or transformers) holds a plain model. A `peft` policy's `state_dict` has other names
(`base_model.model.<name>`, `<layer>.base_layer.weight`, `<layer>.lora_A.default.weight`) and its base weights are
the frozen initial ones, so it cannot be sent as it is. `merged_state` builds, per LoRA layer, the weight
`W + scale * B @ A` with peft's own `merge` (every layer type and variant peft supports: linear, embedding, conv,
DoRA) and copies it to the CPU, then puts the base weight back exactly as it was (a copy of the original, not a
subtraction, so repeated syncs never drift in low precision). Layers are done one at a time: the extra memory is one
layer's weight. Adapter tensors are left out; `modules_to_save` copies are sent under the wrapped module's name.

Only called on a policy whose parameters are whole on this rank (no DeepSpeed ZeRO-3 partitions; the trainer refuses
LoRA under ZeRO-3, see `peft_policy.check_peft_config`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch


def is_peft_model(model) -> bool:
    """True when `model` (already unwrapped) is a `peft.PeftModel`. Never imports peft itself: a model can only be a
    PeftModel once peft has been imported (runs without LoRA do not pay for the import at every sync)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _base_names(model) -> "OrderedDict[str, str | None]":
    """Every key of the base model's state dict (adapters injected) -> the plain model's name, or None for tensors
    the plain model does not have (adapter weights, the original copy behind `modules_to_save`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model()
    wrappers = {}  # module path -> what its tensors' names become
    for path, module in base.named_modules():
        if isinstance(module, BaseTunerLayer):
            wrappers[path] = ("base_layer",)
        elif isinstance(module, ModulesToSaveWrapper):
            wrappers[path] = ("modules_to_save", module.active_adapter
                              if isinstance(module.active_adapter, str) else module.active_adapter[0])
    names: OrderedDict[str, str | None] = OrderedDict()
    for key in base.state_dict().keys():
        renamed = key
        for path, kept in wrappers.items():
            prefix = f"{path}." if path else ""
            if not key.startswith(prefix):
                continue
            rest = key[len(prefix):]
            inner = ".".join(kept) + "."
            renamed = prefix + rest[len(inner):] if rest.startswith(inner) else None
            break
        names[key] = renamed
    return names


@torch.no_grad()
def merged_state(model) -> "OrderedDict[str, torch.Tensor]":
    """CPU copies of the merged weights of the `PeftModel` `model`, named and ordered like the base model's own
    `state_dict` (what `AutoModelForCausalLM.from_pretrained(base)` has). The policy is left exactly as it was."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for path, module in base.named_modules():
        if not isinstance(module, BaseTunerLayer) or module.merged:
            continue
        layer = module.get_base_layer()
        storages = {n: p.data for n, p in layer.named_parameters(recurse=False)}  # merges add in place; DoRA's swaps
        originals = {n: t.clone() for n, t in storages.items()}
        try:
            module.merge(adapter_names=list(module.active_adapters))
            for n, p in layer.named_parameters(recurse=False):
                merged[f"{path}.base_layer.{n}"] = p.detach().to("cpu", copy=True)
        finally:  # the same tensors, with the same values, as before: optimizers and DeepSpeed keep their references
            for n, p in layer.named_parameters(recurse=False):
                p.data = storages[n]
                storages[n].copy_(originals[n])
            module.merged_adapters.clear()
            for adapter in module.active_adapters:  # DoRA caches the weight norm for an unmerge that never comes
                getattr(module, "_caches", {}).pop(f"{adapter}-weight_norm", None)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    state = base.state_dict()
    for key, name in _base_names(model).items():
        if name is None:
            continue
        tensor = merged.get(key)
        out[name] = tensor if tensor is not None else state[key].detach().to("cpu", copy=True)
    return out
