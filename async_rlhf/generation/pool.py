"""The generator pool: starts, feeds, watches and stops the generator processes. Lives on learner rank 0.

Owns: one spawned process per generator device, one inbox queue per generator (learner -> generator) and one
shared outbox (generators -> learner), and a daemon reader thread that drains the outbox. Rollouts go to the
`on_rollouts` callback (the staleness queue); weight acknowledgements and errors are recorded here.

Guarantees:
* every message to a generator is delivered in the order sent (one FIFO inbox per generator);
* `start` returns only once every engine is up, or raises within `start_timeout` naming the generator;
* `check` raises `GeneratorFailed` if a generator reported an error, died, or has not acknowledged a weight
  update within `weight_sync_timeout`;
* `close` always leaves no generator process alive: Shutdown, then terminate, then kill, each bounded in time.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from typing import Callable

from async_rlhf.generation.worker import GeneratorSpec, generator_main
from async_rlhf.staleness_queue import StageTimeout
from async_rlhf.types import GenerationRequest, RolloutBatch, Shutdown, WeightUpdate


class GeneratorFailed(RuntimeError):
    """A generator process reported an error or died."""


class GeneratorPool:
    def __init__(self, specs: list[GeneratorSpec], on_rollouts: Callable[[RolloutBatch], None],
                 start_timeout: float, weight_sync_timeout: float):
        self.specs = specs
        self.on_rollouts = on_rollouts
        self.start_timeout = start_timeout
        self.weight_sync_timeout = weight_sync_timeout
        ctx = mp.get_context("spawn")
        self.inboxes = [ctx.Queue() for _ in specs]
        self.outbox = ctx.Queue()
        self.processes = [
            ctx.Process(target=generator_main, args=(spec, inbox, self.outbox), daemon=True,
                        name=f"async_rlhf-generator-{spec.generator_id}")
            for spec, inbox in zip(specs, self.inboxes)
        ]
        self.loaded_version = {s.generator_id: s.initial_version for s in specs}
        self.load_seconds: list[float] = []  # one entry per acknowledged update
        self._pending_acks: dict[tuple[int, int], float] = {}  # (generator, version) -> time sent
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self.start_seconds = 0.0

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        for p in self.processes:
            p.start()
        ready: set[int] = set()
        while len(ready) < len(self.specs):
            left = self.start_timeout - (time.monotonic() - t0)
            if left <= 0:
                missing = [s.generator_id for s in self.specs if s.generator_id not in ready]
                raise StageTimeout(f"generator start: generator(s) {missing} not ready within "
                                   f"{self.start_timeout:.0f}s (raise generator_start_timeout if the engine is slow)")
            try:
                msg = self.outbox.get(timeout=min(left, 1.0))
            except queue.Empty:
                self._raise_if_dead()
                continue
            if msg.kind == "ready":
                ready.add(msg.generator_id)
            elif msg.kind == "error":
                raise GeneratorFailed(f"generator {msg.generator_id} failed to start:\n{msg.message}")
        self.start_seconds = time.monotonic() - t0
        self._reader = threading.Thread(target=self._read, name="async_rlhf-rollout-reader", daemon=True)
        self._reader.start()

    def close(self, timeout: float = 30.0) -> None:
        for inbox, p in zip(self.inboxes, self.processes):
            if p.is_alive():
                try:
                    inbox.put(Shutdown())
                except (ValueError, OSError):
                    pass
        deadline = time.monotonic() + timeout
        for p in self.processes:
            if p.pid is None:
                continue
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
        self._stop.set()
        if self._reader is not None:
            self._reader.join(5.0)
        for q in [*self.inboxes, self.outbox]:
            q.cancel_join_thread()  # never block interpreter exit on unflushed queue data
            q.close()

    # ---- messages --------------------------------------------------------------------------------------
    def send_weights(self, update: WeightUpdate) -> None:
        now = time.monotonic()
        with self._lock:
            for spec, inbox in zip(self.specs, self.inboxes):
                self._pending_acks[(spec.generator_id, update.version)] = now
                inbox.put(update)

    def send_request(self, generator_id: int, request: GenerationRequest) -> None:
        self.inboxes[generator_id].put(request)

    def min_loaded_version(self) -> int:
        with self._lock:
            return min(self.loaded_version.values())

    def check(self) -> None:
        """Raise if any generator failed, died, or is overdue acknowledging weights."""
        with self._lock:
            if self._errors:
                raise GeneratorFailed(self._errors[0])
            now = time.monotonic()
            for (gid, version), sent in self._pending_acks.items():
                if now - sent > self.weight_sync_timeout:
                    raise StageTimeout(
                        f"weight sync: generator {gid} did not acknowledge weights v{version} within "
                        f"{self.weight_sync_timeout:.0f}s (raise weight_sync_timeout if loading is slow)")
        self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        for spec, p in zip(self.specs, self.processes):
            if p.exitcode is not None and not self._stop.is_set():
                raise GeneratorFailed(f"generator {spec.generator_id} ({spec.device}) exited with code {p.exitcode}")

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self.outbox.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):
                return
            if msg.kind == "rollouts":
                self.on_rollouts(msg)
            elif msg.kind == "weights_loaded":
                with self._lock:
                    self._pending_acks.pop((msg.generator_id, msg.version), None)
                    self.loaded_version[msg.generator_id] = msg.version
                    self.load_seconds.append(msg.seconds)
            elif msg.kind == "error":
                with self._lock:
                    self._errors.append(f"generator {msg.generator_id} failed:\n{msg.message}")
