"""Collecting a `GeneratorPool`'s answers in a test that drives the pool itself: each answer once, keyed, while the
pool's health is checked (a dead generator fails the test at once rather than at the timeout)."""

from __future__ import annotations

import queue
import time
from typing import Callable


class Answers(dict):
    """key(rollouts) -> rollouts, filled from `got` (the pool's `on_rollouts` queue) by `wait_for`."""

    def __init__(self, pool, got: queue.Queue, key: Callable = lambda r: r.batch_id,
                 context: Callable[[], str] = lambda: ""):
        super().__init__()
        self.pool, self.got, self.key, self.context = pool, got, key, context

    def wait_for(self, done: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
        """Until `done()`; fails naming `what` (and `context()`) after `timeout` s, or on a key answered twice."""
        deadline = time.monotonic() + timeout
        while not done():
            self.pool.check()
            try:
                r = self.got.get(timeout=0.01)
            except queue.Empty:
                assert time.monotonic() < deadline, f"{what} within {timeout:.0f} s{self.context()}"
                continue
            assert self.key(r) not in self, f"{self.key(r)} answered twice"
            self[self.key(r)] = r
