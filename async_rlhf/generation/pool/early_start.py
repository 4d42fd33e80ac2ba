"""Generators spawned while the learner loads: engines start during the trainer's construction, not after it.

A generator's start is mostly its own work (importing torch and vLLM or transformers, building its engine: 4-15 s on
the 2-core development CPU), while the learner loads its policy, reference and reward models and builds the Trainer
and, in `train()`, its optimizer. So the trainer's constructor spawns the generators (`spawn_early`, learner rank 0)
as soon as what they start from is known, before it tokenizes the prompts (1 s for the built-in task's 8192) or
loads any model; `train()` then builds the specs it needs as before
(from a checkpoint, a LoRA merge, the loaded policy's dtype) and `adopt_or_close` keeps the early pool only if its
specs are exactly those, else closes it and the pipeline starts the right generators: never a generator on the wrong
weights or settings, at worst the start of before.

Spawned early only with `generator_early_start` (the recipes set it; a trainer built and not trained then starts
nothing) and where the start is known before models load: rank 0, local generator processes (not
`generator_servers`, not Ray actors), a policy given as a local directory, its dtype predicted from
`model_init_kwargs` or its config, and no `resume_from_checkpoint` in the config (a resumed run starts from the
checkpoint's weights). Waits stay bounded and failures named as before (`generation/pool/local.py`): `generator_start_timeout` counts from the spawn, and a generator that fails to
start is reported, naming it, when the pipeline starts. A trainer never trained closes its early generators when it
is garbage-collected or at exit (`generation/pool/local.py`'s finalizer).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from async_rlhf.data.prompts import prompt_text
from async_rlhf.generation.engine.worker import GeneratorSpec, generator_specs
from async_rlhf.generation.pool.backend_choice import resolve_generator_backend
from async_rlhf.generation.pool.backend_probe import ROUNDS, Workload
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.generation.pool.placement import engine_kwargs
from async_rlhf.pipeline.prompt_stream import total_steps
from async_rlhf.types import SamplingSettings

logger = logging.getLogger(__name__)


def choose_backend_and_spawn(args, model, model_config, init_kwargs: dict, train_dataset,
                             tokenizer, stream_engine: type | None = None,
                             pool_class: type[GeneratorPool] = GeneratorPool,
                             before_spawn: Callable | None = None, episodes=None) -> GeneratorPool | None:
    """The trainer's constructor, before the prompts are tokenized and any model loads: decide `generator_backend`
    ('auto': `backend_choice.py`, timed on one step of the dataset's first prompts where the policy has a directory)
    and spawn the generators (`spawn_early`; `stream_engine`: see `worker.GeneratorSpec`; `pool_class`: the local
    pool an optional schedule needs, `choice.make_pool`). `before_spawn(args, workload, dtype)`: what an optional
    schedule decides once the backend is known and before anything starts (`experimental/schedules.py`).
    `episodes`: the run's `EpisodeSpec` (multi-turn), which the generators start with."""
    path = model if isinstance(model, str) and os.path.isfile(os.path.join(model, "config.json")) else None
    dtype = (predicted_dtype(init_kwargs, model_config) if isinstance(model, str)
             else str(next(model.parameters()).dtype).removeprefix("torch."))
    workload = None
    if path and len(train_dataset) >= args.prompts_per_step:  # too few prompts: refused when training starts
        per = args.prompts_per_step
        first = _first_prompts(train_dataset, tokenizer, ROUNDS * per, args.max_length - args.max_new_tokens)
        if len(first) >= per:
            workload = Workload(path, first[:per], SamplingSettings.from_config(args),
                                max(1, total_steps(args, len(train_dataset))), extra_prompt_token_ids=first[per:],
                                multi_turn=episodes is not None)
    architecture = (model_config.architectures or [type(model).__name__])[0]
    resolve_generator_backend(args, model_config, architecture, dtype, workload=workload)
    if before_spawn is not None:
        before_spawn(args, workload, dtype)
    return spawn_early(args, model, dtype, stream_engine, pool_class, episodes)


def _first_prompts(dataset, tokenizer, count: int, max_prompt_length: int) -> list[list[int]]:
    """Token ids of the dataset's first `count` prompts that fit (looking at most at 4 x `count` rows)."""
    out = []
    for prompt in dataset.select(range(min(len(dataset), 4 * count)))["prompt"]:
        tokens = tokenizer(prompt_text(prompt, tokenizer), add_special_tokens=False)["input_ids"]
        if len(tokens) <= max_prompt_length:
            out.append(tokens)
        if len(out) == count:
            break
    return out


def predicted_dtype(init_kwargs: dict, model_config) -> str:
    """The dtype `from_pretrained(path, **init_kwargs)` gives the policy: the one asked for, else ('auto', the
    transformers 5 default) the config's, else float32."""
    dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype"))
    if dtype in (None, "auto"):
        dtype = getattr(model_config, "dtype", None) or "float32"
    return str(dtype).removeprefix("torch.")


def spawn_early(args, model, dtype: str, stream_engine: type | None = None,
                pool_class: type[GeneratorPool] = GeneratorPool, episodes=None) -> GeneratorPool | None:
    """Spawn the generators `train()` will most likely need, and return their pool (None where not predictable)."""
    if (not args.generator_early_start or args.process_index != 0 or args.generator_servers
            or args.resume_from_checkpoint
            or args.generator_launcher != "process" or args.generator_backend not in ("vllm", "transformers")):
        return None
    if not (isinstance(model, str) and os.path.isfile(os.path.join(model, "config.json"))):
        return None
    specs = generator_specs(args, model, engine_kwargs(args, dtype), initial_version=0, stream_engine=stream_engine,
                            episodes=episodes)
    pool = pool_class(specs, None, args.generator_start_timeout, args.weight_sync_timeout,
                      args.generator_max_restarts, weights=args.local_weight_transport)
    pool.spawn()
    return pool


def adopt_or_close(pool: GeneratorPool | None, specs: list[GeneratorSpec], on_rollouts,
                   pool_class: type[GeneratorPool] = GeneratorPool, weights: str = "shm",
                   feeds=None) -> GeneratorPool | None:
    """`pool` wired to `on_rollouts` (and the run's network `feeds`, which it opens at start) if it is a `pool_class`
    running exactly `specs` with weights over `weights`; else close it (None)."""
    if pool is None:
        return None
    if pool.specs == specs and type(pool) is pool_class and pool.weights == weights:
        pool.on_rollouts = on_rollouts
        pool.feeds = feeds
        return pool
    differ = sorted({f for a, b in zip(pool.specs, specs) for f in GeneratorSpec.__dataclass_fields__
                     if getattr(a, f) != getattr(b, f)} | ({"count"} if len(pool.specs) != len(specs) else set())
                    | ({"weights"} if pool.weights != weights else set()))
    logger.info("generators spawned early differ from those needed (%s); starting them again", ", ".join(differ))
    pool.close()
    return None
