"""How a run's generators are scheduled: the seam for schedules beyond the default.

The interface, `GeneratorScheduling`, is the pipeline's (`pipeline/generator_pool.py`). The default,
`FixedGenerators`, is the core's: the generators the run started with serve every batch until the run
ends, and each request is answered by the generator it was sent to. Optional schedules (`experimental/`:
`tail_migration.TailMigration`, `elastic.ElasticGenerators` for `generator_autoscale`) implement the same methods;
which one a run gets is decided above this layer (`experimental/schedules.py`) and handed to the pool.

Who calls what:
- a local pool's reader thread, under the pool's lock: `plan_handoffs` after each answered request, `answered` for
  it, `handoff_arrived` when a holder gives a request back mid-way (`Migrated`);
- the pipeline on learner rank 0, after each optimizer step: `after_step`;
- metrics and the run summary: `stats` (stage-named, cumulative) and `summary` (JSON).
"""

from __future__ import annotations

from async_rlhf.pipeline.generator_pool import GeneratorScheduling, Handoff

__all__ = ["FixedGenerators", "GeneratorScheduling", "Handoff"]


class FixedGenerators:
    """The default schedule: nothing moves between generators, none is added or retired."""

    def plan_handoffs(self, batch_id: int, in_flight: dict[int, dict], starting) -> list[Handoff]:
        return []

    def handoff_arrived(self, key: tuple[int, int], tokens: int) -> int | None:
        return None  # no hand-over is ever expected

    def answered(self, key: tuple[int, int]) -> None:
        pass

    def after_step(self, step: int, wait_seconds: float, queued_version: int) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict:
        return {}
