"""Inter-stage fusion (RLHFuse): learner rank 0 scores each part of a batch (a prompt group when streaming) as soon
as it arrives, while the generators are still producing the rest, so that when the last part lands only its own
scoring remains before the batch can train.

Owns one daemon thread (`async_rlhf-scorer`) and its queue, both on rank 0. The reader thread hands it parts in
arrival order; it takes every part that has arrived and runs them through its stages in order, each stage one call
over all of them (`stage(parts) -> parts`): "reward" (`scoring.score_parts`, `rewards` filled: a group at a time
would run a reward model on batches of n), then, where the learner's loss has a frozen reference model,
"reference" (`fused_reference.reference_parts`, each completion's reference log-probs filled). It passes the parts on in
arrival order to `assemble` (the pipeline's reassembly, which puts a complete batch into the staleness queue). So
a batch reaches the queue already scored, and the learner ranks neither score it again (`scoring.score_rows`) nor
run the reference model on it (`logprobs.sequence_terms`).

Threads: the stages run torch on this thread while the learner's step runs on the main thread; torch gives this
thread the process's intra-op thread count (`torch.set_num_threads`, the learner's share of the cores), and nothing
here touches the policy: the reference is a separate frozen module (not with LoRA, whose reference is the policy
with its adapters switched off, see `trainers/base.py`).

A stage failure (a reward function that raised under `reward_failure="raise"`, ...) stops the thread; `check()`
raises it on rank 0 from the step that waits for rollouts, and the pipeline shares it with every rank.

Hidden fraction: for each batch, the scoring time that ran before its last part arrived, over all of its scoring
time (`scoring/hidden_fraction`, all stages); the rest (the last part's scoring and any backlog) is time the learner
may wait. Per stage (`scoring/<stage>_hidden_fraction`): a stage's time in a call counts as exposed in proportion
to the call's samples whose batch had all its parts arrived when the stage began. One part per batch (batch-level
generation with one generator) hides nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from async_rlhf.types import RolloutBatch

Stage = Callable[[list[RolloutBatch]], list[RolloutBatch]]


class ScoringStage:
    def __init__(self, stages: Stage | list[tuple[str, Stage]], assemble: Callable[[RolloutBatch], bool]):
        """`stages`: [(name, stage)] run in order (a bare callable is one stage named "reward"); `assemble(part)`
        returns True when `part` completed its batch."""
        self.stages = [("reward", stages)] if callable(stages) else list(stages)
        self.assemble = assemble
        self.failure: BaseException | None = None
        self.seconds = 0.0  # scoring time, all parts, all stages
        self.exposed_seconds = 0.0  # from the arrival of a batch's last part until that batch was complete
        self.stage_seconds = {name: 0.0 for name, _ in self.stages}
        self.stage_exposed = {name: 0.0 for name, _ in self.stages}
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # the two below: the reader thread (submit) and this one
        self._chunks: dict[int, set[int]] = {}  # batch id -> chunks arrived
        self._complete_at: dict[int, float] = {}  # batch id -> when its last part arrived
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="async_rlhf-scorer", daemon=True)
        self._thread.start()

    def submit(self, part: RolloutBatch) -> None:
        """Reader thread: a part has arrived."""
        now = time.perf_counter()
        with self._lock:
            chunks = self._chunks.setdefault(part.batch_id, set())
            chunks.add(part.chunk)
            if len(chunks) >= part.num_chunks:
                self._complete_at.setdefault(part.batch_id, now)
        self._inbox.put((part, now))

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10.0)

    @property
    def hidden_fraction(self) -> float:
        return _fraction(self.exposed_seconds, self.seconds)

    def stats(self) -> dict[str, float]:
        out = {"scoring/seconds": self.seconds, "scoring/hidden_fraction": self.hidden_fraction}
        for name, _ in self.stages:
            out[f"scoring/{name}_seconds"] = self.stage_seconds[name]
            out[f"scoring/{name}_hidden_fraction"] = _fraction(self.stage_exposed[name], self.stage_seconds[name])
        return out

    def _exposed_share(self, parts: list[RolloutBatch], at: float) -> float:
        """The share of `parts`' samples whose batch had all its parts arrived by `at`."""
        with self._lock:
            done = {b for b, t in self._complete_at.items() if t <= at}
        sizes = [sum(len(g) for g in p.completions) for p in parts]
        return sum(n for p, n in zip(parts, sizes) if p.batch_id in done) / max(1, sum(sizes))

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
            parts = [part for part, _ in waiting]
            try:
                for name, stage in self.stages:
                    t0 = time.perf_counter()
                    share = self._exposed_share(parts, t0)
                    parts = stage(parts)
                    spent = time.perf_counter() - t0
                    self.seconds += spent
                    self.stage_seconds[name] += spent
                    self.stage_exposed[name] += spent * share
            except BaseException as exc:  # raised on rank 0 by the step waiting for this batch, then on every rank
                self.failure = exc
                return
            for part, (_, arrived) in zip(parts, waiting):
                if self.assemble(part):
                    self.exposed_seconds += time.perf_counter() - arrived
                    with self._lock:
                        self._chunks.pop(part.batch_id, None)
                        self._complete_at.pop(part.batch_id, None)


def _fraction(exposed: float, total: float) -> float:
    return min(1.0, max(0.0, 1.0 - exposed / total)) if total else 0.0
