"""How a step's batch is formed on learner rank 0 from the parts the generators return: the seam for the optional
batch schedules.

`WholeBatches` is the core's schedule: batch b is the prompts `PromptStream.prompts_for_step(b)` names, sent once
admission allows it (queued version >= b - max_staleness), reassembled from its parts (chunks, or prompt groups when
streaming), and put in the staleness queue; step b waits for it and regenerates it if it arrived too stale. Its
micro-batches are slices of it in prompt order, shared with the other learner ranks in one broadcast per step.

Optional schedules (`experimental/`) implement the same methods: `partial_rollouts.PartialBatches` (a step closes
on the first finished groups within the bound) and `arrival_order.ArrivalOrderBatches` (`train_while_generating`:
micro-batches in arrival order). Which one a run gets is decided above this layer (`experimental/schedules.py`).

A schedule is built with a `PipelineAccess`, what it may use of the pipeline and nothing else (the queue, sending,
the liveness check, the records and a few read-only values), and whatever settings its factory binds
(`experimental/schedules.py`). Threads: `arrived` runs on the reader thread (or the scoring thread when parts are
scored as they arrive); everything else on rank 0's main thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Protocol

from async_rlhf.errors import CheckpointError
from async_rlhf.pipeline.records import PipelineRecords
from async_rlhf.pipeline.staleness_queue import StalenessQueue
from async_rlhf.types import RolloutBatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineAccess:
    """What a batch schedule may use of the pipeline on rank 0 (`rollout_pipeline.RolloutPipeline` builds it)."""

    queue: StalenessQueue  # complete batches go in (`put`); a step waits on it (`get`); admission (`admissible`)
    records: PipelineRecords  # counters: `batch_assembled`, `timers["wait"]`, `regenerated`
    send: Callable[..., None]  # send(batch_id, indices=None, attempt=0): the batch (or those groups) to generators
    check: Callable[[], None]  # raises `GeneratorFailed` / `StageTimeout` / a scoring failure: call while waiting
    take_whole: Callable[[int], RolloutBatch]  # take_whole(step): the step's batch from `take`, checked and counted
    queued_version: Callable[[], int]  # the newest weights sent to the generators
    total_steps: Callable[[], int]  # batches the run trains (it grows when the Trainer runs past max_steps)
    pool_size: Callable[[], int]  # generators the run started with
    rollout_timeout: float  # the longest a step waits for its rollouts (seconds)


# (what it may use of the pipeline) -> the run's batch schedule; `experimental/schedules.py` binds the settings
MakeBatchForming = Callable[[PipelineAccess], "BatchForming"]


class BatchForming(Protocol):
    name: str  # saved with a checkpoint's counters; a resume with another schedule is refused
    per_micro_batch: bool  # True: `take_micro` forms each micro-batch (one broadcast each); False: slices of `take`

    def restore(self, version: int, pending: list[RolloutBatch], counters: dict) -> None: ...

    def counters(self) -> dict: ...

    def pending(self, step: int) -> list[RolloutBatch]: ...

    def dispatch(self) -> None: ...

    def arrived(self, part: RolloutBatch) -> bool: ...  # True: the part completed a batch (or stands alone)

    def take(self, step: int) -> RolloutBatch: ...

    def take_micro(self, step: int, micro: int, micro_batches: int, count: int) -> RolloutBatch: ...

    def stats(self) -> dict[str, float]: ...

    def summary(self) -> dict: ...  # {key of the run summary: its content}; {}: nothing to add

    def describe(self, batch: RolloutBatch) -> dict: ...  # more fields of a trained batch's record; {}: none


class WholeBatches:
    """The core schedule (see the module docstring)."""

    name = "whole"
    per_micro_batch = False

    def __init__(self, access: PipelineAccess):
        self.p = access
        self.next_dispatch = 0  # next batch id to send
        self._parts: dict[int, dict[int, RolloutBatch]] = {}  # batch id -> chunk -> rollouts (reader thread)

    # ---- checkpoints -------------------------------------------------------------------------------------------
    def restore(self, version: int, pending: list[RolloutBatch], counters: dict) -> None:
        saved = counters.get("batch_forming", self.name)
        if version > 0 and saved != self.name:
            raise CheckpointError(
                f"resume_from_checkpoint: the checkpoint was saved with the batch schedule {saved!r}, this run forms "
                f"{self.name!r} batches; resume with the settings it was saved with (rollouts in flight are kept "
                "differently)")
        self.next_dispatch = version
        for batch in pending:
            if batch.batch_id >= version:
                self.p.queue.put(batch)

    def counters(self) -> dict:
        return {}

    def pending(self, step: int) -> list[RolloutBatch]:
        """The batches generated for steps after `step`. Those already sent are awaited first (at most
        `rollout_timeout`; not once a generator failed or the pool closed), so that a resumed run trains them as they
        were sampled instead of sampling them again with the checkpoint's newer weights: exact resume also when a
        batch was still being generated (long multi-turn episodes) at the checkpoint."""
        try:
            self.p.queue.wait_for(range(step, self.next_dispatch), self.p.rollout_timeout, poll=self.p.check)
        except Exception as exc:  # a failed or closed pool, or the wait ran out: what arrived is saved
            logger.warning("checkpoint at step %d: batches sent but not arrived (%s: %s) are sampled again on "
                           "resume, with the checkpoint's weights", step, type(exc).__name__, exc)
        return [b for b in self.p.queue.pending() if b.batch_id >= step]

    # ---- main thread -------------------------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Send every batch that admission allows now (batch c once the queued version >= c - max_staleness)."""
        p = self.p
        while self.next_dispatch < p.total_steps() and p.queue.admissible(self.next_dispatch, p.queued_version()):
            if self.next_dispatch not in p.queue:  # restored from a checkpoint: already generated
                p.send(self.next_dispatch)
            self.next_dispatch += 1

    def take(self, step: int) -> RolloutBatch:
        """Batch `step`, waiting at most `rollout_timeout`; regenerated with the current weights if too stale."""
        p = self.p
        while True:
            self.dispatch()
            batch = p.queue.get(step, learner_version=step, timeout=p.rollout_timeout, poll=p.check)
            if batch is not None:
                return batch
            p.records.regenerated += 1
            p.send(step)

    def take_micro(self, step: int, micro: int, micro_batches: int, count: int) -> RolloutBatch:
        raise NotImplementedError("whole batches are sliced by the pipeline (per_micro_batch is False)")

    # ---- reader (or scoring) thread ----------------------------------------------------------------------------
    def arrived(self, part: RolloutBatch) -> bool:
        """Reassemble a batch from its parts; a complete batch goes into the staleness queue (returns True). Its
        version is the oldest of its parts' (the staleness bound holds for every sample)."""
        parts = self._parts.setdefault(part.batch_id, {})
        parts[part.chunk] = part
        if len(parts) < part.num_chunks:
            return False
        del self._parts[part.batch_id]
        ordered = [parts[c] for c in range(part.num_chunks)]
        self.p.records.batch_assembled(part.batch_id, ordered, self.p.pool_size())
        self.p.queue.put(part if part.num_chunks == 1 else RolloutBatch.merged(part.batch_id, ordered))
        return True

    def stats(self) -> dict[str, float]:
        return {}

    def summary(self) -> dict:
        return {}

    def describe(self, batch: RolloutBatch) -> dict:
        return {}
