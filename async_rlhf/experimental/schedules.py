"""Which schedules a run gets: the core's defaults unless an experimental option asks for another. The one place
that maps options to the seams' implementations: batch forming (`pipeline/batch_forming.py`), generator scheduling
(`generation/pool/scheduling.py`), the streaming engine (`generation/engine/stream_engine.py`) and stages of rank 0's
scoring thread (`scoring/stage.py`); the trainer calls it, so neither the pipeline, the pool, the engine nor the
trainer names an option. Options that cannot go together are refused earlier, by the config (`config/checks.py`,
`UNSUPPORTED`)."""

from __future__ import annotations

from async_rlhf.experimental.arrival_order import ArrivalOrderBatches
from async_rlhf.experimental.continuous_batching import ContinuousBatchingEngine
from async_rlhf.experimental.elastic import make_elastic
from async_rlhf.experimental.elastic_pool import ElasticGeneratorPool
from async_rlhf.experimental.fused_reference import reference_parts
from async_rlhf.experimental.partial_rollouts import PartialBatches
from async_rlhf.experimental.speculative.choice import resolve_speculative
from async_rlhf.experimental.tail_migration import HandoffEngine, TailMigration
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.pipeline.batch_forming import MakeBatchForming, WholeBatches


def batch_forming(args) -> MakeBatchForming:
    """The batch schedule's factory: `partial_rollouts` > 0, `train_while_generating`, or whole batches (the core's)."""
    if args.partial_rollouts:
        return lambda access: PartialBatches(access, args.prompts_per_step, args.max_staleness,
                                             args.partial_rollouts, args.max_oldest_staleness)
    if args.train_while_generating:
        return lambda access: ArrivalOrderBatches(access, args.max_staleness)
    return WholeBatches


def generator_scheduling(args, learners: int):
    """The generator schedule's factory for `generation/pool/choice.make_pool`; None: the core's fixed generators.
    `learners`: learner processes (the autoscale rule weighs their cost)."""
    if args.generator_autoscale:
        return lambda pool, new_spec: make_elastic(args, pool, learners, new_spec)
    if args.tail_migration:
        return lambda pool, new_spec: TailMigration(args.tail_migration)
    return None


def stream_engine(args) -> type | None:
    """The engine a streaming generator serves with (`generation/engine/worker.GeneratorSpec.stream_engine`): one that
    can hand requests over mid-sample with `tail_migration`, transformers' continuous batching with
    `continuous_batching` (the config refuses the two together: tail migration is vLLM's); None: the core's
    `StreamEngine`."""
    if args.continuous_batching:
        return ContinuousBatchingEngine
    return HandoffEngine if args.tail_migration else None


def fuses_reference(args, *, ref_model, deepspeed: bool) -> bool:
    """Whether rank 0's scoring thread computes the reference log-probs (`scoring_stages`), so that the learner's
    step skips its reference forward."""
    return bool(args.reference_while_generating and args.score_while_generating and not deepspeed
                and ref_model is not None)


def scoring_stages(args, *, ref_model, deepspeed: bool, packing: dict, temperature: float) -> list:
    """Stages an optional schedule adds to learner rank 0's scoring thread (`scoring/stage.py`), after the rewards:
    with `reference_while_generating`, the reference log-probs of each arriving part (`fused_reference.py`), where
    parts are scored as they arrive (`score_while_generating`, not under DeepSpeed) and the reference is a frozen
    model (not a LoRA policy's adapters-off self). `packing`: pad_id, max_length, device and shared_prefix."""
    if not fuses_reference(args, ref_model=ref_model, deepspeed=deepspeed):
        return []
    return [("reference", lambda parts: reference_parts(parts, ref_model, temperature=temperature, **packing))]


def pool_class(args) -> type[GeneratorPool]:
    """The local generator pool: one whose generators can be added and retired with `generator_autoscale`
    (`elastic_pool.py`); else the core's fixed `GeneratorPool`."""
    return ElasticGeneratorPool if args.generator_autoscale else GeneratorPool


def before_spawn(args, workload, dtype: str) -> None:
    """Decided once the generator backend is known, before any generator starts (`early_start.py`): with
    `speculative="auto"`, which method (or none) pays on this policy and machine (`speculative/choice.py`; only vLLM
    speculates: measured only for vLLM generators). `workload`: `backend_probe.Workload`, None if not measurable."""
    if args.speculative == "auto":
        resolve_speculative(args, workload if args.generator_backend == "vllm" else None, dtype)
