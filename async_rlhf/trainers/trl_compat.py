"""TRL 1.16 `OnlineDPOTrainer`'s constructor contract, so a TRL script runs with our trainers switched by one import.

`check_trl_arguments` makes TRL's checks, with TRL's error types (our `ConfigError` is a `ValueError`), before any
model loads. `set_trl_attributes` sets the public attributes TRL's constructor sets, with TRL's names and meanings
(`reward_funcs`, `reward_func_names`, `reward_processing_classes`, `reward_weights`, `generation_config`, `use_vllm`,
`num_generations`, the sampling values, `eos_token_ids`, ...). Where ours differ (tests/compat/ checks the rest):
- `processing_class` may be omitted when the policy is given as a path holding a tokenizer: it is loaded from
  there; otherwise (a model object, as every TRL script passes) omitting it is TRL's `ValueError`;
- `generation_config` is always a transformers `GenerationConfig` describing what the generators sample with (TRL
  holds a vLLM `SamplingParams` when `use_vllm`); `llm` and `vllm_client` are None: engines live in the generator
  processes, not in the trainer;
- `num_generations` is `args.num_generations` (TRL fixes it at 2; ours takes best vs worst of k >= 2);
- processors (vision-language policies) are refused with a message: only text policies are trained here.

`prepare_group_args` does what TRL 1.16's GRPOTrainer and RLOOTrainer check or decide before their models load:
reward processing classes as TRL counts them (one tokenizer given for two reward functions is TRL's `ValueError`),
and a default `max_length` (ours; TRL has none) lowered to what the policy's position table holds.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase, ProcessorMixin

from async_rlhf.errors import ConfigError


def check_trl_arguments(model, ref_model, reward_funcs, args, reward_processing_classes) -> None:
    """TRL's constructor checks that need no model loaded."""
    if ref_model is not None and ref_model is model:
        raise ConfigError("ref_model: `model` and `ref_model` cannot be the same object; omit ref_model (or pass None) "
                          "to use a frozen copy of the initial policy")
    if args.model_init_kwargs is not None and not isinstance(model, str):
        raise ConfigError("model_init_kwargs: set, but the model is already instantiated; it only applies when "
                          "`model` is a path or hub id")
    n_funcs = len(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else 1
    if isinstance(reward_processing_classes, list) and len(reward_processing_classes) != n_funcs:
        raise ConfigError(f"reward_processing_classes: {len(reward_processing_classes)} given for {n_funcs} reward "
                          "function(s); the number of reward processing classes must match the number of reward "
                          "functions")
    if args.reward_weights is not None and len(args.reward_weights) != n_funcs:
        raise ConfigError(f"reward_weights: number of reward weights ({len(args.reward_weights)}) must match number "
                          f"of reward functions ({n_funcs})")


def prepare_group_args(config_class, model, args, reward_funcs, reward_processing_classes):
    """The GRPO / RLOO constructors' checks before any model loads (module docstring); returns the config."""
    import logging
    import os
    import tempfile

    if args is None:
        args = config_class(output_dir=os.path.join(tempfile.gettempdir(), "async_rlhf-output"))
    n_funcs = len(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else 1
    procs = reward_processing_classes
    if procs is not None and not isinstance(procs, list):
        procs = [procs]
    if procs is not None and len(procs) != n_funcs:  # TRL's message
        raise ConfigError(f"The number of reward processing classes ({len(procs)}) must match the number of reward "
                          f"functions ({n_funcs}).")
    if getattr(args, "max_length_defaulted", False):
        try:
            config = AutoConfig.from_pretrained(model) if isinstance(model, str) else model.config
        except OSError:  # no such model: the base constructor raises the loader's own error
            config = None
        positions = getattr(config, "max_position_embeddings", None)
        if positions and args.max_length > positions > args.max_new_tokens:
            logging.getLogger(__name__).info("max_length: %d (the default) is more than the policy's %d positions; "
                                             "using %d", args.max_length, positions, positions)
            args.max_length = positions
    return args


def refuse_unbuilt(**arguments) -> None:
    """TRL constructor arguments that have nothing to run on here yet: each one given is a ConfigError naming it."""
    given = sorted(name for name, value in arguments.items() if value is not None)
    if given:
        raise ConfigError(f"{', '.join(given)}: not built in async_rlhf's trainers yet (quantized policies, "
                          "custom rollout functions); leave None")


def tokenizer_for(processing_class, model, source_path: str | None):
    """The tokenizer to train with: `processing_class`, or (our extension) the one saved with the policy."""
    if processing_class is None:
        if source_path is None:  # a model object: TRL's contract, whatever its directory holds
            raise ConfigError("processing_class: `processing_class` must be provided (with a model object, as in "
                              "TRL; a policy given as a path loads the tokenizer saved there)")
        try:
            return AutoTokenizer.from_pretrained(source_path)
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"processing_class: `processing_class` must be provided (no tokenizer could be loaded "
                              f"from the policy's path {source_path!r}: {type(exc).__name__})") from None
    if isinstance(processing_class, ProcessorMixin):
        raise ConfigError(f"processing_class: {type(processing_class).__name__} is a processor for vision-language "
                          "models, which are not trained here; pass the text tokenizer")
    if not isinstance(processing_class, PreTrainedTokenizerBase):
        raise TypeError("The `processing_class` must be either a `PreTrainedTokenizerBase` or a `ProcessorMixin`, got "
                        f"{type(processing_class).__name__}")
    return processing_class


def generation_kwargs(args, tokenizer, eos_token_ids: list[int]) -> dict:
    """What every generator samples with, as transformers `GenerationConfig` arguments (greedy at temperature 0)."""
    greedy = args.sampling_temperature == 0  # temperature 0, or TRL's generation_kwargs do_sample=False
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": not greedy, "pad_token_id": tokenizer.pad_token_id,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos_token_ids, "top_k": args.top_k,
              "top_p": args.top_p, "temperature": args.temperature or None,  # kept when greedy, as TRL keeps it
              "repetition_penalty": args.repetition_penalty, "min_p": args.min_p}
    return {k: v for k, v in kwargs.items() if v is not None}


def set_trl_attributes(trainer, args, model, tokenizer) -> None:
    """The public attributes TRL's `OnlineDPOTrainer.__init__` sets (after the scorer is built)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    scorer = trainer.scorer
    trainer.reward_funcs = scorer.funcs  # models placed (and wrapped under DeepSpeed), as TRL's
    trainer.reward_func_names = list(scorer.names)
    trainer.reward_processing_classes = scorer.tokenizers
    trainer.reward_weights = scorer.weights  # float32 tensor, one weight per reward function
    trainer.is_encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    trainer.is_vision_model = model.config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    trainer.max_length = args.max_length
    trainer.use_vllm = args.generator_backend == "vllm" or bool(args.generator_servers)
    trainer.num_generations = args.num_generations
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "vllm_gpu_memory_utilization",
                 "vllm_tensor_parallel_size", "vllm_model_impl"):
        setattr(trainer, name, getattr(args, name))
    trainer.vllm_mode = args.vllm_mode if trainer.use_vllm else None
    trainer.structured_outputs_regex = args.vllm_structured_outputs_regex
    trainer.llm = None  # engines live in the generator processes
    trainer.vllm_client = None
    trainer._tokenizer = tokenizer
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # as TRL: the model agrees on padding
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    trainer.eos_token_ids = declared if tokenizer.eos_token_id in declared else [tokenizer.eos_token_id, *declared]
    trainer.image_token_id = trainer.vision_start_token_id = trainer.vision_end_token_id = trainer.image_token = None
    trainer.generation_kwargs = generation_kwargs(args, tokenizer, trainer.eos_token_ids)
    trainer.generation_config = GenerationConfig(**trainer.generation_kwargs)
    trainer._beta = getattr(args, "beta", None)  # TRL's private twin of `beta`; best-of-n has no KL term

