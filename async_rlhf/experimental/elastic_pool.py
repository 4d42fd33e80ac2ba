"""The local generator pool with membership that changes at run time (`generator_autoscale`): generators added on
spare devices and retired, driven by `elastic.ElasticGenerators`. A `GeneratorPool` whose membership hooks keep the
pool's guarantees while generators come and go:
* `add_generator` starts a generator on a new id; the newest weights are queued first in its inbox, and updates sent
  while it starts are replaced by the newest one when it is ready. Requests go only to `active_generators()`, which
  it joins once ready: it never samples with weights older than those queued when it got its first request;
* `retire_generator` takes a generator out of `active_generators()` at once; it gets `Shutdown` only once every
  request it holds is answered (`check`), so no request is lost, and a retiring generator that dies is restarted and
  re-sent its requests like any other. A retired generator's outbox is read until it exits (its last answers count).
Processes are started from the main thread only (`add_generator` is called from `ElasticGenerators.after_step`).
"""

from __future__ import annotations

import time

from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.generation.pool.processes import stop_process
from async_rlhf.types import Shutdown


class ElasticGeneratorPool(GeneratorPool):
    """`GeneratorPool` with generators added and retired (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._joining: set[int] = set()  # added, not ready yet: no requests, no weights until ready
        self._retiring: dict[int, float] = {}  # taken out of service -> time Shutdown was sent (0: still draining)
        self.retired: dict[int, float] = {}  # generator -> time its process was seen gone
        self._sent_version: dict[int, int] = {}  # joining generator -> version queued to it at spawn

    # ---- what the schedule reads -----------------------------------------------------------------------------
    def joining(self) -> list[int]:
        """Generators added and not ready yet."""
        with self._lock:
            return sorted(self._joining)

    def settled(self) -> bool:
        """No generator is joining or retiring."""
        with self._lock:
            return not self._joining and not self._retiring

    # ---- membership (main thread) ----------------------------------------------------------------------------
    def add_generator(self, spec: GeneratorSpec) -> None:
        """Start one more generator (`spec.generator_id` must be the next id). It joins `active_generators()` once
        ready, with the newest weights queued ahead of any request."""
        if spec.generator_id != len(self.specs):
            raise ValueError(f"add_generator: generator id {spec.generator_id}, expected {len(self.specs)}")
        if self._stopping.is_set():
            return
        inbox, outbox = self.launcher.queues()
        with self._lock:
            gid = spec.generator_id
            self.specs.append(spec)
            self.inboxes.append(inbox)
            self.outboxes.append(outbox)
            self.processes.append(self._process(spec, inbox, outbox))
            self._incarnation.append(0)
            self.restarts[gid] = 0
            self._in_flight[gid] = {}
            self._joining.add(gid)
            self._starting[gid] = time.monotonic()
            self.acks.add(gid, spec.initial_version)
            update = self._last_update
            self._sent_version[gid] = spec.initial_version
            if self.feeds is not None:
                self.feeds.open(gid, inbox)
            if update is not None:
                self._sent_version[gid] = update.version
                self.acks.sent(gid, update.version)
                self._queue_update(gid, update)
        self.processes[gid].start()
        self._forward(gid)

    def retire_generator(self, generator_id: int) -> None:
        """Take a generator out of service now; `check` shuts it down once its requests are answered."""
        with self._lock:
            if generator_id in self._retiring or generator_id in self.retired:
                return
            self._retiring[generator_id] = 0.0

    def advance_retiring(self, now: float) -> None:
        """Shut down retiring generators whose requests are all answered; record those gone, SIGKILL the overdue."""
        with self._lock:
            drained = [g for g, t in self._retiring.items() if t == 0.0 and not self._in_flight[g]
                       and g not in self._starting]
            for g in drained:
                self._retiring[g] = now
                self.acks.remove(g)  # no more updates go to it, none is awaited from it
                self.inboxes[g].put(Shutdown())
            sent = [(g, t) for g, t in self._retiring.items() if t > 0.0]
        for g, t in sent:
            p = self.processes[g]
            if p.exitcode is None and now - t > self.start_timeout:
                stop_process(p, 0.0)
            if p.exitcode is not None:
                with self._lock:
                    del self._retiring[g]
                    self.retired[g] = now
                if self.feeds is not None:
                    self.feeds.drop(g)

    # ---- the pool's membership hooks ---------------------------------------------------------------------------
    def _out_of_service(self) -> set[int]:
        return set(self._joining) | set(self._retiring) | set(self.retired)

    def _takes_updates(self, generator_id: int) -> bool:
        # joining: gets the newest when ready; shut down: gets nothing more
        return not (generator_id in self._joining or generator_id in self.retired
                    or self._retiring.get(generator_id, 0.0) > 0.0)

    def _restart_wanted(self, generator_id: int) -> bool:
        # a retiring generator still draining is restarted (its requests must be answered); one shut down is not
        return not (self._retiring.get(generator_id, 0.0) > 0.0 or generator_id in self.retired)

    def _gone(self) -> set[int]:  # called with the lock held
        return set(self.retired)

    def _ready(self, generator_id: int) -> None:
        if generator_id in self._joining:  # updates sent while it started were held back: the newest now
            update = self._last_update
            if update is not None and update.version > self._sent_version[generator_id]:
                self.acks.sent(generator_id, update.version)
                self._queue_update(generator_id, update)
            self._joining.discard(generator_id)

    def _restarted(self, generator_id: int, version: int) -> None:
        if generator_id in self._joining:
            self._sent_version[generator_id] = version

    def _advance(self, now: float) -> None:
        self.advance_retiring(now)
