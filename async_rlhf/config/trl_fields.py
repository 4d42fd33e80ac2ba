"""TRL 1.16 `OnlineDPOConfig` fields on our configs: what each becomes here (mapped, applied, or a no-op).

A TRL script switched to our classes by one import keeps every field it sets. Our generation differs from TRL's in
one way that decides most of this: it is always asynchronous, in generator processes of their own (on
`generator_devices`, or the servers of `generator_servers`), never inside a learner. So:

* mapped: `use_vllm` True/False -> `generator_backend` 'vllm'/'transformers' (None, our default, leaves it, 'auto'
  unless set); `vllm_mode='server'` (with `use_vllm`) -> `generator_servers = [vllm_server_base_url]` (or
  `host:port`), which must be `python -m async_rlhf.generation.serve` servers, not `trl vllm-serve` ones;
  `generation_kwargs` keys that name a sampling field here (`temperature`, `top_p`, `top_k`, `max_new_tokens` or
  vLLM's `max_tokens`, `min_p`, `repetition_penalty`) override that field, as TRL documents; `do_sample=False`
  sets `temperature = 0` (greedy, as transformers' `do_sample=False`). `min_p` and `repetition_penalty` are
  applied by both generator backends (and vLLM servers), with TRL's meaning.
* meaning kept, nothing to do: `vllm_mode='colocate'` (TRL's default: "vLLM next to training", here vLLM in the
  generator processes), `vllm_gpu_memory_utilization`, `vllm_tensor_parallel_size` (our own fields).
* no-op, named in ONE warning per config when set to anything but TRL's default (`NO_OPS`): sampling options our
  samplers do not apply (other `generation_kwargs` keys, `cache_implementation`,
  `vllm_structured_outputs_regex`), engine options that have no object to act on here
  (`vllm_enable_sleep_mode`, `vllm_group_port`, `vllm_server_timeout`, `vllm_model_impl` other than 'vllm',
  `ds3_gather_for_generation=False`: ZeRO-3 weights are always gathered for the generators) and
  `trust_remote_code=True` (never set: no model code is fetched or run).
Conflicts between a TRL field and the explicit field it maps onto (`use_vllm=False` with
`generator_backend='vllm'`) are a `ConfigError` naming both.
"""

from __future__ import annotations

import logging

from async_rlhf.errors import ConfigError

logger = logging.getLogger(__name__)

VLLM_MODES = ("colocate", "server")
# generation_kwargs key -> the field it overrides
GENERATION_KWARG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "max_new_tokens": "max_new_tokens", "max_tokens": "max_new_tokens", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty"}
# field -> (TRL's default, why it cannot apply here)
NO_OPS = {
    "cache_implementation": (None, "the transformers generator uses its model's default cache"),
    "vllm_structured_outputs_regex": (None, "structured outputs are not passed to the generators"),
    "vllm_enable_sleep_mode": (False, "generators own their devices; there is nothing to free between steps"),
    "vllm_group_port": (51216, "weights reach the generators as shm files or our own broadcast group"),
    "vllm_server_timeout": (240.0, "generator_start_timeout bounds the wait for every generator"),
    "vllm_model_impl": ("vllm", "our engines use vLLM's own model code"),
    "ds3_gather_for_generation": (True, "under ZeRO-3 the weights are always gathered for the generators"),
    "trust_remote_code": (False, "no model code is ever fetched or run"),
}


def apply_trl_fields(config) -> None:
    """Map the TRL fields of `config` onto ours (in place) and warn once about those that cannot apply. Runs after
    the type checks and before the range checks, which then see the mapped values."""
    if config.vllm_mode not in VLLM_MODES:
        raise ConfigError(f"vllm_mode: {config.vllm_mode!r} is not one of {VLLM_MODES}")
    if config.use_vllm is not None:
        wanted = "vllm" if config.use_vllm else "transformers"
        if config.generator_backend not in ("auto", wanted):
            raise ConfigError(f"use_vllm: {config.use_vllm} asks for generator_backend={wanted!r} but "
                              f"generator_backend={config.generator_backend!r} was set; set only one of them")
        config.generator_backend = wanted
    if config.use_vllm and config.vllm_mode == "server" and not config.generator_servers:
        host = "127.0.0.1" if config.vllm_server_host == "0.0.0.0" else config.vllm_server_host
        config.generator_servers = [config.vllm_server_base_url or f"{host}:{config.vllm_server_port}"]
    ignored = _apply_generation_kwargs(config)
    unused = [f"{name}={getattr(config, name)!r} ({why})" for name, (default, why) in NO_OPS.items()
              if getattr(config, name) != default]
    if ignored:
        unused.append(f"generation_kwargs {sorted(ignored)} (only sampling fields we have are applied)")
    if unused:
        logger.warning("%s: TRL field(s) accepted but not applied here: %s", type(config).__name__,
                       "; ".join(unused))


def _apply_generation_kwargs(config) -> list[str]:
    """Apply the keys that name one of our sampling fields; return the others."""
    kwargs = config.generation_kwargs or {}
    for key, name in GENERATION_KWARG_FIELDS.items():
        if key in kwargs:
            setattr(config, name, kwargs[key])
    if kwargs.get("do_sample") is False:
        config.temperature = 0.0
    return [k for k in kwargs if k not in GENERATION_KWARG_FIELDS and k != "do_sample"]
