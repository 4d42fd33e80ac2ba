"""LoRA policies (`peft_config`, as TRL's trainers take it): what changes when only adapters train.

- **The policy** is the base model with LoRA adapters (`peft.get_peft_model`); the optimizer sees only the adapter
  parameters (the `Trainer` builds it from parameters that require a gradient), so gradients and optimizer state
  are those of the adapters (`memory_report` measures both against full fine-tuning).
- **The reference model** is the same base with the adapters switched off (`adapters_off`), never a second copy:
  a trainer built with a `peft_config` and no `ref_model` has `ref_model = None` (as TRL's), and
  `logprobs.sequence_terms` then runs the policy inside `adapters_off` for the reference's log-probs.
- **The generators** get the base weights with the adapters merged in, under the base model's parameter names
  (`weight_sync/lora_merge.py`, called by `gather_full_state`), through the usual weight path; they never know
  about LoRA. They start from the base model's directory while the adapters are still zero, else from a merged
  copy (after a resume, or an adapter that starts non-zero).
- **Checkpoints** hold the adapter only (`adapter_model.safetensors`, the `Trainer`'s own save of a `PeftModel`);
  on resume the adapter is loaded before the generators start, so they start from the checkpoint's merged weights.

Not supported (refused with a message before any model loads): non-LoRA PEFT methods (prompt tuning and the like
cannot be merged into plain weights) and DeepSpeed ZeRO-3 (merging needs whole layers).
"""

from __future__ import annotations

import contextlib
import os

import torch

from async_rlhf.errors import ConfigError
from async_rlhf.weight_sync.gather import _unwrap
from async_rlhf.weight_sync.lora_merge import is_peft_model, merged_state

ADAPTER_FILE = "adapter_model.safetensors"


def is_peft_policy(model) -> bool:
    """True for a LoRA policy, wrapped (DDP, DeepSpeed) or not."""
    return is_peft_model(_unwrap(model))


def check_peft_config(peft_config, model) -> None:
    """The checks TRL 1.16's trainers make on `peft_config` (same error types), plus ours; cheap, before any model
    loads."""
    if peft_config is None:
        return
    try:
        from peft import LoraConfig, PeftConfig
    except ImportError as exc:
        raise ImportError("peft_config: you passed a peft_config but the peft library is not installed "
                          "(pip install peft==0.21.2)") from exc
    if not isinstance(peft_config, PeftConfig):
        raise TypeError(f"peft_config: must be a peft.PeftConfig instance (e.g. peft.LoraConfig), got "
                        f"{type(peft_config).__name__}")
    if is_peft_model(model):
        raise ValueError("model: you passed a PeftModel together with a peft_config; merge and unload its adapter, "
                         "save the base model, and pass that base model with the new peft_config")
    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"peft_config: only LoRA (peft.LoraConfig) is supported, got {type(peft_config).__name__}: "
                          "the generators receive the adapters merged into the base weights")
    task = getattr(peft_config.task_type, "value", peft_config.task_type)
    if task not in (None, "CAUSAL_LM"):
        raise ConfigError(f"peft_config.task_type: the policy is a causal LM; expected 'CAUSAL_LM' (or None), got "
                          f"{task!r}")
    from async_rlhf.learner.frozen_models import zero3_enabled

    if zero3_enabled():
        raise ConfigError("peft_config: LoRA policies under DeepSpeed ZeRO-3 are not supported (merging the "
                          "adapters for the generators needs whole layers); use ZeRO-2 "
                          "(launch/accelerate/cpu_deepspeed_zero2.yaml, gpu_deepspeed_zero2.yaml) or DDP")


def wrap_policy(model: torch.nn.Module, peft_config, args) -> torch.nn.Module:
    """The policy with LoRA adapters: `model` wrapped by `peft_config`, or a `PeftModel` passed in as it is (its
    adapters must be LoRA and trainable). A plain model without `peft_config` is returned unchanged."""
    if peft_config is None and not is_peft_model(model):
        return model
    if args.gradient_checkpointing:  # checkpointed blocks need an input that requires grad: the embeddings are frozen
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {})
        model.enable_input_require_grads()
    if peft_config is not None:
        from peft import get_peft_model

        with torch.random.fork_rng(devices=[]):  # adapters initialised from `seed`: a run is reproducible
            torch.manual_seed(args.seed)
            model = get_peft_model(model, peft_config)
    from peft import LoraConfig

    for name, config in model.peft_config.items():
        if not isinstance(config, LoraConfig):
            raise ConfigError(f"model: adapter {name!r} is {type(config).__name__}; only LoRA adapters are supported")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError("model: the PeftModel has no trainable parameters; load its adapter with "
                          "is_trainable=True (PeftModel.from_pretrained(base, path, is_trainable=True))")
    return model


@contextlib.contextmanager
def adapters_off(model):
    """The policy as the reference model: its base weights with every adapter switched off, in eval mode and without
    gradient. Yields the module to call; on exit the adapters and the train/eval mode are as they were."""
    peft_model = _unwrap(model)
    if not is_peft_model(peft_model):
        raise ValueError(f"ref_model: None is only allowed for a LoRA policy (the base with adapters off); the "
                         f"policy is a {type(peft_model).__name__}")
    was_training = peft_model.training
    peft_model.eval()
    try:
        with peft_model.disable_adapter(), torch.no_grad():
            yield peft_model
    finally:
        peft_model.train(was_training)


def adapters_are_identity(model) -> bool:
    """True when merging changes no weight, so the generators may start from the base model's own directory: every
    trained tensor is a LoRA A, or a LoRA B that is all zero (peft's default initialisation). Anything else (DoRA
    magnitudes, `modules_to_save` copies, trained B, base weights rewritten by PiSSA-style initialisations, which
    come with a non-zero B): False."""
    for name, p in _unwrap(model).named_parameters():
        if not p.requires_grad or ".lora_A." in name or ".lora_embedding_A." in name:
            continue
        if (".lora_B." in name or ".lora_embedding_B." in name) and not p.detach().any():
            continue
        return False
    return True


def forward_model(model) -> torch.nn.Module:
    """What evaluation code that wants a transformers `PreTrainedModel` should run: the LoRA policy's base model,
    whose layers carry the (active) adapters, or `model` itself."""
    return model.get_base_model() if is_peft_model(model) else model


def savable_model(model) -> torch.nn.Module:
    """The module whose `save_pretrained(state_dict=merged)` writes a plain model directory a generator loads."""
    return forward_model(_unwrap(model))


def load_adapter_checkpoint(model, checkpoint: str) -> None:
    """Load the adapter weights saved in `checkpoint` into the LoRA policy (before the generators start, so that they
    start from the checkpoint's merged weights; the `Trainer` loads the same file again when it resumes)."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    from async_rlhf.errors import CheckpointError

    path = os.path.join(checkpoint, ADAPTER_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"resume_from_checkpoint: {checkpoint} has no {ADAPTER_FILE}; it was not saved by a "
                              "run with a LoRA policy (peft_config)")
    peft_model = _unwrap(model)
    result = set_peft_model_state_dict(peft_model, load_file(path), adapter_name=peft_model.active_adapter)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise CheckpointError(f"resume_from_checkpoint: {path} holds tensors this policy's adapters do not have "
                              f"({unexpected[:3]}...): saved with another peft_config")


def base_state_dict(model) -> dict[str, torch.Tensor]:
    """The policy's weights under the base model's names (merged for a LoRA policy), e.g. to initialise a critic."""
    model = _unwrap(model)
    return merged_state(model) if is_peft_model(model) else model.state_dict()


def _optimizer_state_bytes(optimizer) -> int | None:
    """Bytes of tensors in the state of the optimizer that steps (the innermost torch optimizer behind accelerate's
    and DeepSpeed's wrappers)."""
    found = None
    while optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            found = optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    if found is None:
        return None
    return sum(t.numel() * t.element_size() for state in found.state.values() for t in state.values()
               if torch.is_tensor(t))


def memory_report(model, optimizer) -> dict:
    """Parameters trained, their gradients and the optimizer's state (measured), against full fine-tuning of the same
    model: every base parameter trained, with the same optimizer-state bytes per parameter. The base parameters are
    the frozen ones (each base weight is held once, in its LoRA layer's `base_layer` or behind `modules_to_save`)."""
    params = list(_unwrap(model).parameters())
    trained = [p for p in params if p.requires_grad]
    frozen = [p for p in params if not p.requires_grad]
    n_trained = sum(p.numel() for p in trained)
    n_base = sum(p.numel() for p in frozen)
    state = _optimizer_state_bytes(optimizer)
    per_param = state / n_trained if state and n_trained else None
    return {
        "trainable_parameters": n_trained,
        "base_parameters": n_base,
        "trainable_fraction": n_trained / n_base if n_base else 0.0,
        "gradient_bytes": sum(p.numel() * p.element_size() for p in trained),
        "gradient_bytes_full_finetune": sum(p.numel() * p.element_size() for p in frozen),
        "optimizer_state_bytes": state,
        "optimizer_state_bytes_full_finetune": round(per_param * n_base) if per_param else None,
    }


def format_memory_report(r: dict) -> str:
    state = r["optimizer_state_bytes"]
    state_text = (f"optimizer state {state / 1e6:.2f} MB vs {r['optimizer_state_bytes_full_finetune'] / 1e6:.2f} MB "
                  "for full fine-tuning" if state else "optimizer state not measured")
    return (f"LoRA: training {r['trainable_parameters']:,} parameters, {100 * r['trainable_fraction']:.2f}% of the "
            f"model's {r['base_parameters']:,} | gradients {r['gradient_bytes'] / 1e6:.2f} MB vs "
            f"{r['gradient_bytes_full_finetune'] / 1e6:.2f} MB | {state_text}")


def get_peft_config(script) -> "object | None":
    """TRL's `get_peft_config(model_args)` for our recipes' flags (`--use_peft --lora_r ...`, `tasks.ScriptArguments`):
    a `peft.LoraConfig`, or None without `--use_peft`."""
    if not script.use_peft:
        return None
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise ImportError("use_peft: the peft library is not installed (pip install peft==0.21.2)") from exc
    if script.lora_r < 1:
        raise ConfigError(f"lora_r: must be >= 1, got {script.lora_r}")
    if not 0.0 <= script.lora_dropout < 1.0:
        raise ConfigError(f"lora_dropout: must be in [0, 1), got {script.lora_dropout}")
    targets = script.lora_target_modules
    if targets is not None and len(targets) == 1:  # one value may be a special name such as 'all-linear'
        targets = targets[0]
    return LoraConfig(task_type="CAUSAL_LM", r=script.lora_r, lora_alpha=script.lora_alpha,
                      lora_dropout=script.lora_dropout, target_modules=targets, bias="none",
                      modules_to_save=script.lora_modules_to_save, use_rslora=script.use_rslora)
