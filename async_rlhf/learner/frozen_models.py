"""The frozen models beside the policy (reference, reward models) under accelerate and DeepSpeed.

The policy itself is prepared by the transformers `Trainer` (accelerate wraps it in a DeepSpeed engine with the
optimizer). The models that are only run forward need the same care, or ZeRO-3 silently loses its point:
- ZeRO-3: `from_pretrained` partitions a model while it loads (`deepspeed.zero.Init`, switched on by the
  DeepSpeed config that accelerate registers with transformers), so a frozen model must be loaded from its path
  (a `deepcopy` of a partitioned policy copies placeholders, not weights) and then run inside a DeepSpeed engine
  of its own, which gathers each layer's partitions for its forward pass. Every rank holds 1/world of it.
- ZeRO-1/2 shard only optimizer state and gradients, which a frozen model has none of: it is replicated on
  every rank (engine at stage 0, which still casts it to the run's bf16/fp16 precision).
This is what TRL 1.16 does for its reference and reward models (`trl.models.utils.prepare_deepspeed`): the
training config minus its optimizer, scheduler and optimizer offload, at stage 3 or 0.
"""

from __future__ import annotations

import copy
import os

import torch

from async_rlhf.errors import ConfigError


def zero3_enabled() -> bool:
    """True while a DeepSpeed ZeRO-3 config is registered with transformers (models then load partitioned)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def reference_model(policy: torch.nn.Module, policy_path: str | None, init_kwargs: dict) -> torch.nn.Module:
    """A frozen copy of the policy's initial weights: loaded again from its path under ZeRO-3, copied otherwise."""
    from transformers import AutoModelForCausalLM

    if not zero3_enabled():
        return copy.deepcopy(policy)
    path = policy_path or getattr(policy.config, "_name_or_path", None)
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("ref_model: under DeepSpeed ZeRO-3 the policy's parameters are partitioned and cannot be "
                         "copied; pass the policy as a path (or a model loaded from a local directory), or pass "
                         "ref_model explicitly")
    return AutoModelForCausalLM.from_pretrained(path, **init_kwargs)


def _frozen_engine_config(train_config: dict, hidden_size: int | None) -> dict:
    """The training DeepSpeed config turned into an inference-only one (no optimizer state to shard)."""
    config = copy.deepcopy(train_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = config.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero.get("stage", 0) != 3:
        config["zero_optimization"] = {"stage": 0}
        return config
    # ZeRO-3 sizes that transformers fills from the model ("auto") only when it prepares the policy at train time
    if hidden_size is not None:
        defaults = {"reduce_bucket_size": hidden_size * hidden_size,
                    "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                    "stage3_param_persistence_threshold": 10 * hidden_size}
        for key, value in defaults.items():
            if zero.get(key, "auto") == "auto":
                zero[key] = value
    return config


def prepare_frozen(model: torch.nn.Module, accelerator) -> torch.nn.Module:
    """Place a forward-only model for this run: a DeepSpeed inference engine under DeepSpeed (partitioned at
    ZeRO-3, replicated otherwise), else the model on the accelerator's device. Returns what to call."""
    model.eval().requires_grad_(False)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return model.to(accelerator.device)
    import deepspeed  # only under DeepSpeed: importing it sets up its own accelerator detection

    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    engine, *_ = deepspeed.initialize(model=model, config=_frozen_engine_config(plugin.deepspeed_config, hidden))
    engine.eval()
    return engine
