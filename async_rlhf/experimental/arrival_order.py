"""Micro-batches in arrival order (`train_while_generating`): a step's gradient-accumulation micro-batches train as its
prompt groups arrive, instead of all of them waiting for the whole batch.

An optimizer step with `gradient_accumulation_steps` = k runs k micro-batches (forward and backward each), then
steps. Without this, micro-batch 0 waits for the whole batch (`RolloutPipeline.batch_for_step`) and micro-batch m is
its m-th slice in prompt order. With it, micro-batch m < k - 1 is the next `per_micro` groups of the step's batch in
the order they reached learner rank 0 (scored, when scoring runs as parts arrive), taken as soon as that many have:
its forward and backward run while the generators still sample the rest, and when the batch's last group lands only
the last micro-batch remains, not the whole step. The last micro-batch waits for the whole batch as before (its
staleness check, counters and records are the batch's) and takes the groups left. This is RLHFuse's inter-stage
fusion carried one stage further, from scoring to the learner's own forward and backward.

What it changes and what it does not:
- The step trains exactly the groups of its batch, each once, within the staleness bound (admission dispatched
  the batch, so every part of it is within the bound when it arrives; each early micro-batch is checked again here,
  and a batch of which groups were trained early can never be dropped afterwards: an error says so).
- The gradient is the mean of the k micro-batch losses, as with any gradient accumulation; which groups share a
  micro-batch follows their arrival (short completions first), not their prompt order, so it can differ between two
  runs of the same samples. A batch restored from a checkpoint is complete from the start and is split in prompt
  order.

`ArrivalOrderBatches` is the batch schedule (`pipeline/batch_forming.py`) that forms the micro-batches;
`ArrivalOrder` keeps each batch's groups in arrival order.

Threads: `add` runs on the reader or scoring thread (whichever assembles parts), before the part's batch can reach
the staleness queue; `take`, `rest` and `has` run on rank 0's main thread.

Experimental because it has not paid where measured: 1.02x the streaming run's loop on 2 CPU cores (1.12x in a
6-step invocation), no GPU measurement (docs/performance.md, Verdicts).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from async_rlhf.errors import StageTimeout
from async_rlhf.pipeline.batch_forming import PipelineAccess, WholeBatches
from async_rlhf.pipeline.rank_share import check_logprobs_finite
from async_rlhf.types import RolloutBatch

POLL_SECONDS = 1.0  # liveness checks while a micro-batch waits for its groups


class ArrivalOrder:
    """Rank 0: each batch's prompt groups in the order they arrived, and how many the step has taken so far."""

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self._cond = threading.Condition()
        self._groups: dict[int, list[tuple[RolloutBatch, int]]] = {}  # batch id -> (part, row), arrival order
        self._taken: dict[int, int] = {}  # batch id -> groups taken (a prefix of the arrival order)
        self._parts: dict[int, set[int]] = {}  # batch id -> chunks arrived
        self._complete: set[int] = set()  # batches every part of which has arrived
        self.early = 0  # micro-batches taken while their batch was still being generated
        self.early_groups = 0

    def add(self, part: RolloutBatch) -> None:
        with self._cond:
            self._groups.setdefault(part.batch_id, []).extend((part, r) for r in range(len(part.prompt_ids)))
            chunks = self._parts.setdefault(part.batch_id, set())
            chunks.add(part.chunk)
            if len(chunks) == part.num_chunks:
                self._complete.add(part.batch_id)
            self._cond.notify_all()

    def has(self, batch_id: int) -> bool:
        with self._cond:
            return batch_id in self._groups

    def take(self, batch_id: int, count: int, timeout: float, poll: Callable[[], None] | None = None) -> RolloutBatch:
        """The next `count` groups of batch `batch_id` in arrival order, once they have arrived (at most `timeout`
        seconds; `poll` about once a second, it may raise). Step `batch_id` will train them."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                start = self._taken.get(batch_id, 0)
                have = len(self._groups.get(batch_id, ()))
                if have >= start + count:
                    taken = self._groups[batch_id][start:start + count]
                    self._taken[batch_id] = start + count
                    early = batch_id not in self._complete
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageTimeout(f"rollouts: micro-batch of step {batch_id} waited {timeout:g} s for "
                                       f"{start + count} of its prompt groups and {have} arrived (rollout_timeout; "
                                       "train_while_generating)")
                self._cond.wait(min(left, POLL_SECONDS))
            if poll is not None:
                poll()
        micro = _merged(batch_id, taken)
        if batch_id - micro.policy_version > self.max_staleness:  # admission makes this impossible: never train it
            raise RuntimeError(f"train_while_generating: a group of batch {batch_id} arrived with version "
                               f"{micro.policy_version}, over max_staleness {self.max_staleness}; admission should "
                               "have prevented it")
        self.early += early
        self.early_groups += len(taken) * early
        return micro

    def rest(self, batch: RolloutBatch) -> RolloutBatch:
        """The groups of the complete `batch` (step `batch.batch_id`'s, as the staleness queue gave it) not taken yet,
        in arrival order; forgets the batch."""
        with self._cond:
            arrived, start = self._groups.get(batch.batch_id, []), self._taken.get(batch.batch_id, 0)
            self._forget(batch.batch_id)
        if len(arrived) != len(batch.prompt_ids):
            raise RuntimeError(f"train_while_generating: step {batch.batch_id} trained {start} of its groups early "
                               f"but its batch came back with {len(batch.prompt_ids)} groups after {len(arrived)} "
                               "arrived (dropped and regenerated?); refusing to train any group twice")
        return _merged(batch.batch_id, arrived[start:])

    def forget_before(self, batch_id: int) -> None:
        """Drop what is kept of batches before `batch_id` (steps already trained)."""
        with self._cond:
            for b in [b for b in self._groups if b < batch_id]:
                self._forget(b)

    def _forget(self, batch_id: int) -> None:
        """Under the lock: drop everything kept of batch `batch_id`."""
        self._groups.pop(batch_id, None)
        self._taken.pop(batch_id, None)
        self._parts.pop(batch_id, None)
        self._complete.discard(batch_id)


def _merged(batch_id: int, entries: list[tuple[RolloutBatch, int]]) -> RolloutBatch:
    """One batch of the (part, row) groups `entries`, in that order."""
    return RolloutBatch.merged(batch_id, [part.select([row]) for part, row in entries])


class ArrivalOrderBatches(WholeBatches):
    """Whole batches whose micro-batches (but the last) are taken in arrival order (see the module docstring)."""

    per_micro_batch = True  # its checkpoints are whole batches' (`name` stays "whole")

    def __init__(self, access: PipelineAccess, max_staleness: int):
        super().__init__(access)
        self.arrivals = ArrivalOrder(max_staleness)
        self._fused_step = False  # the current step's micro-batches are taken in arrival order
        self._whole: RolloutBatch | None = None  # the current step's batch, when taken whole

    def arrived(self, part: RolloutBatch) -> bool:
        self.arrivals.add(part)  # before its batch can reach the queue
        return super().arrived(part)

    def take_micro(self, step: int, micro: int, micro_batches: int, count: int) -> RolloutBatch:
        p = self.p
        if micro == 0:  # a batch restored from a checkpoint is whole from the start: prompt order
            self._fused_step = self.arrivals.has(step) or step not in p.queue
            self.arrivals.forget_before(step)
        if not self._fused_step:
            if micro == 0:
                self._whole = p.take_whole(step)
            return self._whole.select(list(range(micro * count, (micro + 1) * count)))
        if micro < micro_batches - 1:
            t0 = time.perf_counter()
            self.dispatch()
            part = self.arrivals.take(step, count, p.rollout_timeout, p.check)
            p.records.timers["wait"] += time.perf_counter() - t0
            check_logprobs_finite(part)
            return part
        return self.arrivals.rest(p.take_whole(step))

    def stats(self) -> dict[str, float]:
        return {"learner/early_micro_batches": float(self.arrivals.early)}

    def summary(self) -> dict:
        """For the run summary: micro-batches trained before their batch was complete."""
        return {"early_micro_batches": float(self.arrivals.early)}
