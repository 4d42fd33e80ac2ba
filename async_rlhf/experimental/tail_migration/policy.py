"""Tail migration's rule and book: which requests move, to which generator, and what moved.

A generator schedule (`pipeline/generator_pool.GeneratorScheduling`): the local pool calls it under its lock, and it
uses only the pool's `RequestBook`; the generators do the moving (`engine.HandoffEngine`):
1. when an answer leaves at most `threshold` requests of its batch in flight on at least two generators, the target
   is the generator holding most of them (ties: the lowest id), and each other holder gets a `TailHandoff`;
2. a holder answers with `Migrated` (the request, each sample as it stands): the request moves to the target's
   in-flight table and inbox (`RequestBook.move`), so a target that dies re-samples it from there like any request;
3. a holder that finished the request before the hand-over arrived answers as usual (the `TailHandoff` then finds
   nothing); a holder that dies first re-samples its original request when restarted. Either way the request is
   answered once, by one generator.
Each batch is handed over at most once.
"""

from __future__ import annotations

import collections

from async_rlhf.experimental.tail_migration.messages import TailHandoff
from async_rlhf.generation.pool.scheduling import FixedGenerators, RequestBook
from async_rlhf.types import RolloutBatch

Handoff = tuple[int, tuple[int, int], int]  # (holder, (batch, chunk), target)


class TailMigration(FixedGenerators):
    """The hand-over rule and its counters. Not thread-safe: the pool calls it under its lock."""

    def __init__(self, threshold: int):
        self.threshold = threshold
        self._done: set[int] = set()  # batches handed over
        self._pending: dict[tuple[int, int], int] = {}  # (batch, chunk) -> target, until the holder answers
        self.handoffs = 0  # TailHandoff messages sent
        self.moved = 0  # requests moved
        self.moved_tokens = 0  # tokens their samples had when moved (kept, not sampled again)

    # ---- the seam ----------------------------------------------------------------------------------------
    def answered(self, rollouts: RolloutBatch, requests: RequestBook) -> None:
        self.request_ended((rollouts.batch_id, rollouts.chunk))
        for holder, key, _ in self.plan_handoffs(rollouts.batch_id, requests.in_flight(), requests.starting()):
            requests.put(holder, TailHandoff(*key))

    def message(self, message, requests: RequestBook) -> bool:
        if message.kind != "migrated":
            return False
        key = (message.request.batch_id, message.request.chunk)
        target = self.handoff_arrived(key, message.tokens)
        if target is not None:
            requests.move(key, message.generator_id, target, message.request)
        return True

    def stats(self) -> dict[str, float]:
        if not self.threshold:
            return {}
        return {"generator/tail_handoffs": float(self.handoffs), "generator/tail_moved": float(self.moved),
                "generator/tail_moved_tokens": float(self.moved_tokens)}

    def summary(self) -> dict[str, dict]:
        return {"tail_migration": {"handoffs": self.handoffs, "moved": self.moved,
                                   "moved_tokens": self.moved_tokens}} if self.threshold else {}

    # ---- the rule ----------------------------------------------------------------------------------------
    def plan_handoffs(self, batch_id: int, in_flight: dict[int, dict], starting) -> list[Handoff]:
        """(holder, request key, target) for each request of `batch_id` to hand over now; [] if none.
        `in_flight`: generator -> {(batch, chunk): request}; `starting`: generators restarting (left alone)."""
        if not self.threshold or batch_id in self._done:
            return []
        held = [(g, key) for g, requests in in_flight.items() for key in requests if key[0] == batch_id]
        holders = collections.Counter(g for g, _ in held)
        if not held or len(held) > self.threshold or len(holders) < 2 or any(g in starting for g in holders):
            return []
        target = max(sorted(holders), key=lambda g: holders[g])
        self._done.add(batch_id)
        moves = [(g, key, target) for g, key in held if g != target]
        for _, key, _ in moves:
            self._pending[key] = target
        self.handoffs += len(moves)
        return moves

    def handoff_arrived(self, key: tuple[int, int], tokens: int) -> int | None:
        """A holder's `Migrated` for request `key`: its target, or None if the hand-over is no longer expected."""
        target = self._pending.pop(key, None)
        if target is not None:
            self.moved += 1
            self.moved_tokens += tokens
        return target

    def request_ended(self, key: tuple[int, int]) -> None:
        """Request `key` was answered (its holder finished it first): no hand-over is expected for it any more."""
        self._pending.pop(key, None)
