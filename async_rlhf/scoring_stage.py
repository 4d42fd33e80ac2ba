"""Inter-stage fusion (RLHFuse): learner rank 0 scores each part of a batch (a prompt group when streaming) as soon
as it arrives, while the generators are still producing the rest, so that when the last part lands only its own
scoring remains before the batch can train.

Owns one daemon thread (`async_rlhf-scorer`) and its queue, both on rank 0. The reader thread hands it parts in
arrival order; it takes every part that has arrived, scores them together in one call of each reward function
(`score(parts) -> parts` with `rewards` filled, `scoring.score_parts`: a group at a time would run a reward model on
batches of n), and passes them on in arrival order to `assemble` (the pipeline's reassembly, which puts a complete
batch into the staleness queue). So a batch reaches the queue already scored, and the learner ranks do not score it
again (`scoring.score_rows`).

A reward failure (a reward function that raised under `reward_failure="raise"`, ...) stops the thread; `check()`
raises it on rank 0 from the step that waits for rollouts, and the pipeline shares it with every rank.

Hidden fraction: for each batch, the scoring time that ran before its last part arrived, over all of its scoring
time (`scoring/hidden_fraction`); the rest (the last part's scoring and any backlog) is time the learner waits. One
part per batch (batch-level generation with one generator) hides nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from async_rlhf.types import RolloutBatch


class ScoringStage:
    def __init__(self, score: Callable[[list[RolloutBatch]], list[RolloutBatch]],
                 assemble: Callable[[RolloutBatch], bool]):
        """`assemble(part)` returns True when `part` completed its batch."""
        self.score = score
        self.assemble = assemble
        self.failure: BaseException | None = None
        self.seconds = 0.0  # scoring time, all parts
        self.exposed_seconds = 0.0  # from the arrival of a batch's last part until that batch was complete
        self._inbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="async_rlhf-scorer", daemon=True)
        self._thread.start()

    def submit(self, part: RolloutBatch) -> None:
        """Reader thread: a part has arrived."""
        self._inbox.put((part, time.perf_counter()))

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)

    @property
    def hidden_fraction(self) -> float:
        return min(1.0, max(0.0, 1.0 - self.exposed_seconds / self.seconds)) if self.seconds else 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                waiting = [self._inbox.get(timeout=0.2)]
            except queue.Empty:
                continue
            while True:  # and everything else that has arrived
                try:
                    waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            t0 = time.perf_counter()
            try:
                scored = self.score([part for part, _ in waiting])
            except BaseException as exc:  # raised on rank 0 by the step waiting for this batch, then on every rank
                self.failure = exc
                return
            self.seconds += time.perf_counter() - t0
            for part, (_, arrived) in zip(scored, waiting):
                if self.assemble(part):
                    self.exposed_seconds += time.perf_counter() - arrived
