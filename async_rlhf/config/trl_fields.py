"""TRL 1.16 `OnlineDPOConfig` fields on our configs: what each becomes here (mapped, applied, or a no-op).

A TRL script switched to our classes by one import keeps every field it sets. Our generation differs from TRL's in
one way that decides most of this: it is always asynchronous, in generator processes of their own (on
`generator_devices`, or the servers of `generator_servers`), never inside a learner. So:

* mapped: `use_vllm=True` -> `generator_backend='vllm'`; `use_vllm=False`, TRL's default and ours, leaves
  `generator_backend` ('auto' unless set: the transformers generator where vLLM cannot serve the policy or was
  measured slower on CPU, as TRL's `use_vllm=False` samples with transformers; `generator_backend='transformers'`
  forces it); `vllm_mode='server'` (with `use_vllm`) -> `generator_servers = [vllm_server_base_url]` (or
  `host:port`), which must be `python -m async_rlhf.generation.serve` servers, not `trl vllm-serve` ones;
  `generation_kwargs` keys that name a sampling field here (`temperature`, `top_p`, `top_k`, `max_new_tokens` or
  vLLM's `max_tokens`, `min_p`, `repetition_penalty`) override that field, as TRL documents; `do_sample=False`
  makes the generators greedy (`sampling_temperature` 0, as transformers' `do_sample=False`) and leaves
  `temperature` as set, as TRL's `generation_config` keeps it. `min_p` and `repetition_penalty` are
  applied by both generator backends (and vLLM servers), with TRL's meaning.
* meaning kept, nothing to do: `vllm_mode='colocate'` (TRL's default: "vLLM next to training", here vLLM in the
  generator processes), `vllm_gpu_memory_utilization`, `vllm_tensor_parallel_size` (our own fields).
* no-op, named in ONE warning per config when set to anything but TRL's default (`NO_OPS`): sampling options our
  samplers do not apply (other `generation_kwargs` keys, `cache_implementation`,
  `vllm_structured_outputs_regex`), engine options that have no object to act on here
  (`vllm_enable_sleep_mode`, `vllm_group_port`, `vllm_server_timeout`, `vllm_model_impl` other than 'vllm',
  `ds3_gather_for_generation=False`: ZeRO-3 weights are always gathered for the generators) and
  `trust_remote_code=True` (never set: no model code is fetched or run).
Conflicts between a TRL field and the explicit field it maps onto (`use_vllm=True` with
`generator_backend='transformers'`) are a `ConfigError` naming both.

TRL 1.16 `GRPOConfig` / `RLOOConfig` fields on the group learners (`AsyncGroupRLConfig`: GRPO, RLOO),
`apply_group_fields`:
* mapped: `max_completion_length` <-> `max_new_tokens` (either; TRL's name wins where both are set; 512 when
  neither is, TRL's default);
  `vllm_max_model_length` -> `vllm_max_model_len`; `sync_ref_model` with `ref_model_mixup_alpha` and
  `ref_model_sync_steps` mix the policy into the reference as TRL does (`trainers/policy_gradient.SyncReference`); `per_device_train_batch_size`, `generation_batch_size` and
  `steps_per_generation` count completions, with TRL's rules and error messages; a `steps_per_generation` of m x
  `gradient_accumulation_steps` (m > 1) is `num_mini_batches` m, TRL's meaning (m steps trained on completions of
  one policy), a divisor of `gradient_accumulation_steps` changes nothing (a step's policy is one either way).
* `num_iterations` > 1: that many optimizer passes over each step's batch against the proximal policy (the
  learner before the step); TRL counts each pass as a global step, here they make one step (one batch, one version).
* refused with a message where the value would change training and is not built here:
  `multi_objective_aggregation='normalize_then_sum'`, a per_device_train_batch_size that is not a multiple of
  num_generations (micro-batches hold whole prompt groups here), a steps_per_generation that straddles optimizer
  steps.
* mapped onto the generators: `use_transformers_continuous_batching=True` (or the deprecated
  `use_transformers_paged`) -> `continuous_batching=True`, with `transformers_continuous_batching_config` ->
  `continuous_batching_config` (transformers' continuous batching in our generator processes, streaming:
  `experimental/continuous_batching/`).
* no-op, in the same one warning as above (`GROUP_NO_OPS`): logging and engine options of TRL's in-process
  generation, the entropy bonus and masking, TRL's vLLM importance-sampling correction
  (here `off_policy_correction` does that job), the 'vespo' loss's parameters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

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


# GRPOConfig / RLOOConfig field -> (TRL's default, why it cannot apply here); only the fields a config has count
GROUP_NO_OPS = {
    "num_generations_eval": (None, "evaluation here is the task's (tasks/evaluation.py), not the trainer's"),
    "shuffle_dataset": (True, "prompts are always drawn in a seeded permutation per epoch"),
    "pad_to_multiple_of": (None, "rows are padded to the longest of their length bucket"),
    "router_aux_loss_coef": (None, "no mixture-of-experts auxiliary loss is added"),
    "log_completions": (False, "every trained batch's prompts are in trained_batches.jsonl; no table is printed"),
    "log_multimodal": (True, "text policies only"),
    "num_completions_to_print": (None, "no completions table is printed"),
    "log_unique_prompts": (False, "no completions table is printed"),
    "log_completions_hub_repo": (None, "nothing is uploaded"),
    "cast_lm_head_to_fp32": (False, "the head runs in the policy's dtype"),
    "top_entropy_quantile": (1.0, "every completion token trains (entropy masking is not built)"),
    "entropy_coef": (0.0, "no entropy bonus is built"),
    "use_adaptive_entropy": (False, "no entropy bonus is built"),
    "entropy_coef_min": (0.0, "no entropy bonus is built"),
    "entropy_coef_max": (1.0, "no entropy bonus is built"),
    "entropy_coef_delta": (0.005, "no entropy bonus is built"),
    "entropy_target": (0.2, "no entropy bonus is built"),
    "vllm_importance_sampling_correction": (True, "off_policy_correction corrects the generator/learner mismatch"),
    "vllm_importance_sampling_mode": ("sequence_mask", "off_policy_correction chooses the correction"),
    "vllm_importance_sampling_clip_max": (3.0, "is_cap bounds the importance weights"),
    "vllm_importance_sampling_clip_min": (None, "is_floor bounds the importance weights"),
    "vllm_importance_sampling_cap": (None, "is_cap bounds the importance weights"),
    "off_policy_mask_threshold": (None, "off_policy_correction='masked' drops tokens outside [is_floor, is_cap]"),
    "vespo_k_pos": (2.0, "the 'vespo' loss is not built"),
    "vespo_lambda_pos": (3.0, "the 'vespo' loss is not built"),
    "vespo_k_neg": (3.0, "the 'vespo' loss is not built"),
    "vespo_lambda_neg": (2.0, "the 'vespo' loss is not built"),
}
DEFAULT_COMPLETION_LENGTH = 512  # TRL 1.16's max_completion_length
DEFAULT_MAX_LENGTH = 512  # ours (prompt + completion), unless 2 x the completion length is more


@dataclass
class TRLGenerationFields:
    """TRL 1.16 `OnlineDPOConfig`'s generation fields, accepted under TRL's names (mixed into `AsyncRLConfig`); what
    each becomes here is this module's docstring, applied by `apply_trl_fields`."""

    use_vllm: bool = field(default=False, metadata={"help": "TRL: True sets generator_backend='vllm'; False (TRL's "
                                                            "default) leaves generator_backend ('auto' unless set; "
                                                            "generator_backend='transformers' forces that)."})
    vllm_mode: str = field(default="colocate", metadata={"help": "TRL: 'colocate' (default): vLLM runs in our "
                           "generator processes on generator_devices, never inside a learner; 'server' with use_vllm: "
                           "generator_servers = vllm_server_base_url (or host:port), an async_rlhf.generation.serve."})
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "TRL: server URL (vllm_mode='server')."})
    vllm_server_host: str = field(default="0.0.0.0", metadata={"help": "TRL: server host (vllm_mode='server')."})
    vllm_server_port: int = field(default=8000, metadata={"help": "TRL: server port (vllm_mode='server')."})
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "TRL: no-op (generator_start_timeout)."})
    vllm_group_port: int = field(default=51216, metadata={"help": "TRL: no-op (weights go through shm files)."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "TRL: no-op unless 'vllm' (our engines use vLLM's "
                                                                   "own model code)."})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "TRL: no-op."})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "TRL: no-op (generators own their "
                                                                          "devices; nothing to free)."})
    generation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "TRL: its keys temperature, top_p, top_k, min_p, repetition_penalty, "
                                "max_new_tokens (or vLLM's max_tokens) override those fields; do_sample=False samples "
                                "greedily (sampling_temperature 0; temperature keeps its value, as TRL's "
                                "generation_config); other keys are not applied (warned)."})
    cache_implementation: str | None = field(default=None, metadata={"help": "TRL: no-op."})
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "TRL: no-op; ZeRO-3 weights are always "
                                                                            "gathered for the generators."})
    trust_remote_code: bool = field(default=False, metadata={"help": "TRL: no-op; model code is never fetched."})


def _world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def apply_group_fields(config) -> None:
    """TRL's RLOOConfig / GRPOConfig rules on a group learner's config (in place), before the shared checks: the
    completion length, TRL's batch arithmetic with its checks and messages, and the fields that map onto ours."""
    mct, mnt = config.max_completion_length, config.max_new_tokens
    # TRL's name wins where both are set (a recipe's task config sets max_new_tokens; a flag may then set TRL's)
    config.max_new_tokens = config.max_completion_length = (
        mct if mct is not None else mnt if mnt is not None else DEFAULT_COMPLETION_LENGTH)
    config.max_length_defaulted = config.max_length is None  # the trainer may lower it to the policy's positions
    if config.max_length is None:
        config.max_length = max(DEFAULT_MAX_LENGTH, 2 * config.max_new_tokens)
    if config.vllm_max_model_length is not None:
        config.vllm_max_model_len = config.vllm_max_model_length
    if config.use_transformers_paged:
        config.use_transformers_continuous_batching = True
    _continuous_batching_fields(config)
    if not 0 < config.ref_model_mixup_alpha <= 1:
        raise ConfigError(f"ref_model_mixup_alpha: must be in (0, 1], got {config.ref_model_mixup_alpha}")
    if config.ref_model_sync_steps < 1:
        raise ConfigError(f"ref_model_sync_steps: must be >= 1, got {config.ref_model_sync_steps}")
    if config.auto_find_batch_size:  # TRL's check and message
        raise ConfigError(f"auto_find_batch_size is not supported by {_trl_name(config)}, because the generation "
                          "batch must contain full prompt groups of num_generations completions, and reducing the "
                          "batch size on out-of-memory breaks this invariant. Set auto_find_batch_size=False and "
                          "lower per_device_train_batch_size instead.")
    _batch_sizes(config)


def _continuous_batching_fields(config) -> None:
    """TRL's `use_transformers_continuous_batching` / `transformers_continuous_batching_config` -> our
    `continuous_batching` / `continuous_batching_config` (`config/experimental.py`); TRL reads its config only with
    the flag on, and so does this."""
    if not config.use_transformers_continuous_batching:
        return
    config.continuous_batching = True
    theirs, ours = config.transformers_continuous_batching_config, config.continuous_batching_config
    if theirs is None:
        return
    if ours is not None and ours != theirs:
        raise ConfigError(f"transformers_continuous_batching_config={theirs!r} and continuous_batching_config="
                          f"{ours!r} disagree; set one of them")
    config.continuous_batching_config = theirs


def pad_multiple(value):
    """TRL's `pad_to_multiple_of` as it holds it after its checks: 'auto' is None off Neuron; the CLI passes text."""
    if isinstance(value, str):
        text = value.lower()
        if text in ("auto", "none", "null"):
            return None
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"pad_to_multiple_of: {value!r} is not 'auto', None or an integer") from None
    return value


def _trl_name(config) -> str:
    return "RLOO" if type(config).__name__ == "AsyncRLOOConfig" else "GRPO"


def _batch_sizes(config) -> None:
    """TRL 1.16's generation-batch arithmetic (its messages), then what a generation batch means here."""
    per, processes, accumulation = config.per_device_train_batch_size, _world_size(), config.gradient_accumulation_steps
    gbs, spg = config.generation_batch_size, config.steps_per_generation
    if gbs is None and spg is None:
        spg = accumulation
        gbs = per * processes * spg
    elif gbs is not None and spg is None:
        if gbs % (per * processes) != 0:
            raise ConfigError(f"generation_batch_size ({gbs}) must be divisible by the global batch size "
                              f"({per * processes}).")
        spg = gbs // (per * processes)
    elif gbs is None and spg is not None:
        gbs = per * processes * spg
    else:
        raise ConfigError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the "
                          "same time")
    config.generation_batch_size, config.steps_per_generation = gbs, spg
    k = config.num_generations
    if gbs % k != 0:
        raise ConfigError(f"generation_batch_size ({gbs}) must be divisible by num_generations ({k}).")
    if k < 2:
        raise ConfigError(f"{_trl_name(config)} requires at least 2 generations per prompt to calculate the "
                          f"advantages. You provided {k}, which is less than the minimum required.")
    if per % k != 0:
        raise ConfigError(f"per_device_train_batch_size: {per} completions is not a multiple of num_generations "
                          f"({k}): here each micro-batch holds whole prompt groups (TRL only needs the generation "
                          f"batch to); use per_device_train_batch_size {max(k, per // k * k)} (and adjust "
                          "gradient_accumulation_steps to keep the completions per step)")
    if spg % accumulation == 0 and spg > accumulation:
        m = spg // accumulation
        if config.num_mini_batches not in (None, m):
            raise ConfigError(f"steps_per_generation: {spg} = {m} x gradient_accumulation_steps means {m} steps "
                              f"trained on one policy's completions (num_mini_batches {m}), but num_mini_batches="
                              f"{config.num_mini_batches} was set; set only one of them")
        config.num_mini_batches = m
    elif accumulation % spg != 0:
        raise ConfigError(f"steps_per_generation: {spg} with gradient_accumulation_steps {accumulation}: a generation "
                          "batch here never straddles two optimizer steps; use a divisor or a multiple of "
                          "gradient_accumulation_steps")


def apply_trl_fields(config) -> None:
    """Map the TRL fields of `config` onto ours (in place) and warn once about those that cannot apply. Runs after
    the type checks and before the range checks, which then see the mapped values."""
    if config.vllm_mode not in VLLM_MODES:
        raise ConfigError(f"vllm_mode: {config.vllm_mode!r} is not one of {VLLM_MODES}")
    if config.use_vllm:
        if config.generator_backend not in ("auto", "vllm"):
            raise ConfigError(f"use_vllm: True asks for generator_backend='vllm' but "
                              f"generator_backend={config.generator_backend!r} was set; set only one of them")
        config.generator_backend = "vllm"
    if config.use_vllm and config.vllm_mode == "server" and not config.generator_servers:
        host = "127.0.0.1" if config.vllm_server_host == "0.0.0.0" else config.vllm_server_host
        config.generator_servers = [config.vllm_server_base_url or f"{host}:{config.vllm_server_port}"]
    ignored = _apply_generation_kwargs(config)
    unused = [f"{name}={getattr(config, name)!r} ({why})" for name, (default, why) in {**NO_OPS, **GROUP_NO_OPS}.items()
              if hasattr(config, name) and getattr(config, name) != default]
    if ignored:
        unused.append(f"generation_kwargs {sorted(ignored)} (only sampling fields we have are applied)")
    if unused and getattr(config, "_trl_warning", None) != unused:  # once per config (policy gradient checks twice)
        config._trl_warning = unused
        logger.warning("%s: TRL field(s) accepted but not applied here: %s", type(config).__name__,
                       "; ".join(unused))


def _apply_generation_kwargs(config) -> list[str]:
    """Apply the keys that name one of our sampling fields; return the others."""
    kwargs = config.generation_kwargs or {}
    for key, name in GENERATION_KWARG_FIELDS.items():
        if key in kwargs:
            setattr(config, name, kwargs[key])
    # do_sample=False keeps `temperature` (as TRL's generation_config does); `sampling_temperature` reads it as 0
    return [k for k in kwargs if k not in GENERATION_KWARG_FIELDS and k != "do_sample"]
