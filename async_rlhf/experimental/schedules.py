"""Which schedules a run gets: the core's defaults unless an experimental option asks for another. The one place
that maps options to the seams' implementations (`pipeline/batch_forming.py`, `generation/pool/scheduling.py`);
the trainer calls it, so neither the pipeline nor the pool names an option. Options that cannot go together are
refused earlier, by the config (`config/checks.py`, `UNSUPPORTED`)."""

from __future__ import annotations

from async_rlhf.experimental.arrival_order import ArrivalOrderBatches
from async_rlhf.experimental.elastic import make_elastic
from async_rlhf.experimental.partial_rollouts import PartialBatches
from async_rlhf.experimental.tail_migration import HandoffEngine, TailMigration
from async_rlhf.pipeline.batch_forming import WholeBatches


def batch_forming(args):
    """The batch schedule: `partial_rollouts` > 0, `train_while_generating`, or whole batches (the core's)."""
    if args.partial_rollouts:
        return PartialBatches
    if args.train_while_generating:
        return ArrivalOrderBatches
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
    can hand requests over mid-sample with `tail_migration`; None: the core's `StreamEngine`."""
    return HandoffEngine if args.tail_migration else None
