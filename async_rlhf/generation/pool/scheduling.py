"""How a run's generators are scheduled: the seam for schedules beyond the default.

The interface, `GeneratorScheduling`, is the pipeline's (`pipeline/generator_pool.py`), with what a schedule may use
of a local pool, `RequestBook`. The default, `FixedGenerators`, is the core's: the generators the run started with
serve every batch until the run ends, and each request is answered by the generator it was sent to. Optional
schedules (`experimental/`) implement the same methods; which one a run gets is decided above this layer
(`experimental/schedules.py`) and handed to the pool.

Who calls what:
- a local pool's reader thread, under the pool's lock: `answered` after a request's first answer went to the
  pipeline, `message` for a generator's message of a kind the pool does not know;
- the pipeline on learner rank 0, after each optimizer step: `after_step`;
- metrics and the run summary: `stats` (stage-named, cumulative) and `summary` (sections of the run summary).
"""

from __future__ import annotations

from async_rlhf.pipeline.generator_pool import GeneratorScheduling, RequestBook
from async_rlhf.types import RolloutBatch

__all__ = ["FixedGenerators", "GeneratorScheduling", "RequestBook"]


class FixedGenerators:
    """The default schedule: nothing moves between generators, none is added or retired."""

    def answered(self, rollouts: RolloutBatch, requests: RequestBook) -> None:
        pass

    def message(self, message, requests: RequestBook) -> bool:
        return False

    def after_step(self, step: int, wait_seconds: float, queued_version: int) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict[str, dict]:
        return {}
