"""The generator pool: starts, feeds, watches, restarts and stops the generator processes. Lives on learner rank 0.

Owns: one spawned process per generator device, and per generator process an inbox queue (learner -> generator) and
an outbox queue (generator -> learner); one daemon forwarder thread per outbox, which moves its messages into one
in-process queue, and a daemon reader thread that serves that queue. Rollouts go to the `on_rollouts` callback (the
staleness pipeline, called from the reader thread only); acknowledgements, readiness and errors are recorded here.
A restarted generator gets a new inbox and a new outbox: a process SIGKILLed while writing into its outbox leaves the
queue's write lock held and a message half-written, so that queue is never used again (a shared outbox would silence
every generator after such a kill). Messages still arriving from a replaced process are dropped, except its error
report (the requests it held are re-issued anyway).

Guarantees:
* every message to a generator is delivered in the order sent (one FIFO inbox per generator);
* `spawn` starts the processes and returns at once (the learner loads its models meanwhile: `early_start.py`);
  `start` (which spawns first if that was not done) returns only once every engine is up, or raises naming the
  generator; `start_timeout` counts from the spawn;
* a generator that dies or reports an error is restarted (at most `max_restarts` times per generator) with the
  newest weights, and the requests it had not answered are re-issued to it: no batch is lost. Past the limit,
  `check` raises `GeneratorFailed` naming the generator and its last error;
* `check` raises `StageTimeout` if a generator has not acknowledged a weight update within `weight_sync_timeout`
  (`AckTracker`, shared with the remote pool), or a restarted engine is not up within `start_timeout`;
* once `begin_stop` was called (the trainer got SIGINT/SIGTERM) no generator is restarted: `check` raises
  `GeneratorFailed` for one that died instead of starting another engine on the way out;
* `close` always leaves no generator process alive: Shutdown, then SIGKILL (generators ignore SIGTERM and SIGINT, see
  `worker.py`), each bounded in time; SIGKILL at once where `start` never completed (an engine still starting reads
  no inbox). A pool never closed (its owner left by an unexpected path) kills its generators
  when it is garbage-collected or at interpreter exit, before `multiprocessing` would join them forever.

Membership hooks, each with the fixed pool's behaviour as its default, for a pool whose generators come and go (an
optional schedule's subclass, chosen in `experimental/schedules.py`: `experimental/elastic_pool.py`). Called with the
pool's lock held: `_out_of_service()` (ids that take no requests now), `_takes_updates(g)`, `_gone()` (ids that owe
no acknowledgement), `_ready(g)`, `_restarted(g, version)`; without it, from `check`: `_restart_wanted(g)`,
`_advance(now)`.

Weights over the network (`weight_transport='network'`): `feeds` (`network_feeds.py`) gives each generator process
a weight group of its own, joined first thing (its `WeightGroupJoin` precedes everything in a new inbox: at `start`,
at a restart, at `add_generator`), and sends each update queued to it on a thread of its own; a restarted or added
generator receives the next version queued to it, like every other transport.

Processes are started from the main thread only (`start`, `check` which restarts, `add_generator`): a generator's
parent-death signal is tied to the thread that spawned it. How a generator is started is the launcher's business:
`processes.ProcessLauncher` (spawned processes, the default) or `ray_launcher.RayLauncher` (Ray actors,
`generator_launcher='ray'`); both give the queue and process surface this pool uses.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import queue
import threading
import time
from typing import Callable

from async_rlhf.errors import GeneratorFailed, StageTimeout
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.generation.pool.processes import ProcessLauncher, kill_all, see_log, stop_process
from async_rlhf.generation.pool.scheduling import FixedGenerators, GeneratorScheduling
from async_rlhf.pipeline.generator_pool import AckTracker
from async_rlhf.types import GenerationRequest, RolloutBatch, Shutdown, WeightUpdate

logger = logging.getLogger(__name__)


class GeneratorPool:
    """Generator processes on this machine (see `pipeline/generator_pool.GeneratorPoolProtocol`)."""

    def __init__(self, specs: list[GeneratorSpec], on_rollouts: Callable[[RolloutBatch], None] | None,
                 start_timeout: float, weight_sync_timeout: float, max_restarts: int = 3, launcher=None,
                 weights: str = "shm", feeds=None):
        self.specs = list(specs)
        self.on_rollouts = on_rollouts
        self.start_timeout = start_timeout
        self.weight_sync_timeout = weight_sync_timeout
        self.max_restarts = max_restarts
        self.launcher = launcher or ProcessLauncher()
        boxes = [self.launcher.queues() for _ in self.specs]
        self.inboxes = [b[0] for b in boxes]
        self.outboxes = [b[1] for b in boxes]
        self.processes = [self._process(*args) for args in zip(self.specs, self.inboxes, self.outboxes)]
        self._merged: queue.Queue = queue.Queue()  # (generator index, incarnation, message) from every outbox
        self._incarnation = [0] * len(self.specs)  # bumped at each restart; older messages are stale
        self.answered: dict[int, list[int]] = {}  # generator -> [parts answered, oldest policy_version among them]
        self.acks = AckTracker([s.generator_id for s in self.specs], self.specs[0].initial_version,
                               weight_sync_timeout)
        self.restarts = {s.generator_id: 0 for s in self.specs}
        self._in_flight: dict[int, dict[tuple[int, int], GenerationRequest]] = {s.generator_id: {} for s in self.specs}
        self._last_update: WeightUpdate | None = None
        self.scheduling: GeneratorScheduling = FixedGenerators()  # set by `choice.make_pool` before `start`
        self.feeds = feeds  # `network_feeds.NetworkFeeds` for the "network" weight transport (`choice.weight_route`)
        self.weights = weights  # how weights reach the generators (shm, ipc or network): `choice.GeneratorPlan`
        self.places: dict[int, dict] = {}  # generator -> {device, where, weights} of its latest incarnation, once ready
        self._starting: dict[int, float] = {}  # generator -> time a restart was spawned (until Ready)
        self._errors: dict[int, str] = {}  # generator -> last error reported
        self._lock = threading.Lock()
        self._stop = threading.Event()  # close() began: the reader stops
        self._stopping = threading.Event()  # begin_stop() or close() was called: no more restarts
        self._reader: threading.Thread | None = None
        self._spawned_at: float | None = None  # time.monotonic() of `spawn`
        self.start_seconds = 0.0  # spawn -> every engine up
        self.start_wait_seconds = 0.0  # of which the caller of `start` waited (the rest overlapped its own work)
        # runs before multiprocessing's exit handler terminates (SIGTERM, ignored) and joins daemonic children
        self._kill_at_exit = multiprocessing.util.Finalize(self, kill_all, args=(self.processes,), exitpriority=10)

    def _placed(self, ready) -> None:
        spec = next(s for s in self.specs if s.generator_id == ready.generator_id)
        place = {"device": spec.device, "where": ready.where or "process on this host", "weights": self.weights}
        if self.places.get(ready.generator_id) != place:
            logger.info("generator %d (%s): %s, weights over %s", ready.generator_id, spec.device, place["where"],
                        self.weights)
        self.places[ready.generator_id] = place

    def _process(self, spec: GeneratorSpec, inbox, outbox):
        return self.launcher.process(spec, inbox, outbox)

    @property
    def num_generators(self) -> int:
        return len(self.active_generators())

    def active_generators(self) -> list[int]:
        """Generators that take requests (restarting ones included: their requests wait in their inbox)."""
        with self._lock:
            out = self._out_of_service()
        return [s.generator_id for s in self.specs if s.generator_id not in out]

    # ---- membership hooks (see the module docstring): a fixed pool's generators all serve to the end ------------
    def _out_of_service(self) -> set[int]:
        return set()

    def _takes_updates(self, generator_id: int) -> bool:
        return True

    def _restart_wanted(self, generator_id: int) -> bool:
        return True

    def _gone(self) -> set[int]:
        return set()

    def _ready(self, generator_id: int) -> None:
        pass

    def _restarted(self, generator_id: int, version: int) -> None:
        pass

    def _advance(self, now: float) -> None:
        pass

    def _forward(self, i: int) -> None:
        """Start the thread that moves generator i's current outbox into `_merged`, tagged with its incarnation."""
        outbox, incarnation = self.outboxes[i], self._incarnation[i]

        def forward():
            while not self._stop.is_set() and self._incarnation[i] == incarnation:
                try:
                    msg = outbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                except (EOFError, OSError, ValueError):
                    return
                self._merged.put((i, incarnation, msg))

        threading.Thread(target=forward, name=f"async_rlhf-outbox-{i}.{incarnation}", daemon=True).start()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start every generator process and return at once; `start` waits for their engines."""
        if self._spawned_at is not None:
            return
        self._spawned_at = time.monotonic()
        for i, p in enumerate(self.processes):
            p.start()
            self._forward(i)

    def start(self) -> None:
        """Spawn (unless `spawn` was called) and wait until every engine is up; `on_rollouts` must be set by then."""
        if self.on_rollouts is None:
            raise ValueError("GeneratorPool.start: on_rollouts is not set")
        self.spawn()
        if self.feeds is not None:  # nothing is queued to the generators yet: each group's join goes first
            for spec, inbox in zip(self.specs, self.inboxes):
                self.feeds.open(spec.generator_id, inbox)
        t0, waited_from = self._spawned_at, time.monotonic()
        ready: set[int] = set()
        while len(ready) < len(self.specs):
            left = self.start_timeout - (time.monotonic() - t0)
            if left <= 0:
                missing = [s.generator_id for s in self.specs if s.generator_id not in ready]
                raise StageTimeout(f"generator start: generator(s) {missing} not ready within "
                                   f"{self.start_timeout:.0f}s of being spawned (raise generator_start_timeout if the engine is slow)")
            try:
                _, _, msg = self._merged.get(timeout=min(left, 1.0))
            except queue.Empty:
                for spec, p in zip(self.specs, self.processes):
                    if p.exitcode is not None:
                        raise GeneratorFailed(f"generator {spec.generator_id} ({spec.device}) exited with code "
                                              f"{p.exitcode} during start-up{see_log(spec)}")
                continue
            if msg.kind == "ready":
                ready.add(msg.generator_id)
                self._placed(msg)
            elif msg.kind == "error":
                raise GeneratorFailed(f"generator {msg.generator_id} failed to start:\n{msg.message}"
                                      f"{see_log({s.generator_id: s for s in self.specs}[msg.generator_id])}")
        self.start_seconds = time.monotonic() - t0
        self.start_wait_seconds = time.monotonic() - waited_from
        self._reader = threading.Thread(target=self._read, name="async_rlhf-rollout-reader", daemon=True)
        self._reader.start()

    def begin_stop(self) -> None:
        """The run is stopping: restart no generator from now on (sets a flag only, so safe in a signal handler)."""
        self._stopping.set()

    def close(self, timeout: float = 20.0) -> None:
        """Wait (at most `timeout`) for every live generator to acknowledge the weights sent to it, then stop them
        all (Shutdown, then SIGKILL, again at most `timeout`). What is still unacknowledged stays in `acks.pending()`."""
        self._stopping.set()
        if self._reader is not None and self._reader.is_alive():
            self._await_acks(timeout)
        self._stop.set()
        for inbox, p in zip(self.inboxes, self.processes):
            if p.is_alive():
                try:
                    inbox.put(Shutdown())
                except (ValueError, OSError):
                    pass
        # a pool never started (spawned early by a trainer that was not trained, or failed to build): its generators
        # are still starting, and read no inbox until their engine is up, so they are killed at once
        deadline = time.monotonic() + (timeout if self._reader is not None else 0.0)
        for p in self.processes:
            stop_process(p, max(0.0, deadline - time.monotonic()))
        if self._reader is not None:
            self._reader.join(5.0)
        for q in [*self.inboxes, *self.outboxes]:
            q.cancel_join_thread()  # never block interpreter exit on unflushed queue data
            q.close()
        self._kill_at_exit()  # nothing left to kill: only drops the exit hook
        if self.feeds is not None:
            self.feeds.close()
        self.launcher.close()

    def _await_acks(self, timeout: float) -> None:
        """Until no live generator owes an acknowledgement, or `timeout`. The run's last weights are sent right
        before the pool is closed, and a generator acknowledges them only once it has loaded them (after the
        request it is sampling); without this wait the reader stopped first and the summary missed them. A
        generator that died, reported an error or is restarting owes nothing (it will never answer)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                gone = set(self._errors) | set(self._starting) | self._gone()
            owing = [g for g in self.acks.pending()
                     if g not in gone and g < len(self.processes) and self.processes[g].exitcode is None]
            if not owing:
                return
            if time.monotonic() >= deadline:
                logger.warning("generator pool: closing with weights unacknowledged after %.0fs: %s", timeout,
                               {g: self.acks.pending()[g] for g in owing})
                return
            time.sleep(0.05)

    # ---- messages --------------------------------------------------------------------------------------
    def send_weights(self, update: WeightUpdate) -> None:
        with self._lock:
            self._last_update = update
            for spec, inbox in zip(self.specs, self.inboxes):
                gid = spec.generator_id
                if not self._takes_updates(gid):
                    continue
                self.acks.sent(gid, update.version)
                self._queue_update(gid, update)

    def _queue_update(self, gid: int, update: WeightUpdate) -> None:
        """Queue `update` in generator `gid`'s inbox (FIFO with its requests) and, for the network, to its feed."""
        self.inboxes[gid].put(update)
        if self.feeds is not None:
            self.feeds.send(gid, update.version)

    def send_request(self, generator_id: int, request: GenerationRequest) -> None:
        with self._lock:
            self._in_flight[generator_id][(request.batch_id, request.chunk)] = request
            self.inboxes[generator_id].put(request)

    # ---- what a generator schedule may use (`pipeline/generator_pool.RequestBook`; reader thread, lock held) -----
    def in_flight(self) -> dict[int, dict[tuple[int, int], object]]:
        return self._in_flight

    def starting(self) -> set[int]:
        return set(self._starting)

    def put(self, generator_id: int, message) -> None:
        self.inboxes[generator_id].put(message)

    def move(self, key: tuple[int, int], source: int, target: int, request) -> bool:
        """Request `key` goes on on `target` (in flight there from now, so a target that dies re-samples it)."""
        if self._in_flight[source].pop(key, None) is None:
            return False
        self._in_flight[target][key] = request
        self.inboxes[target].put(request)
        return True

    # ---- health --------------------------------------------------------------------------------------
    def check(self) -> None:
        """Restart dead generators; raise if one failed for good or a stage is overdue. Main thread only."""
        now = time.monotonic()
        with self._lock:
            starting = dict(self._starting)
        self.acks.overdue(exempt=starting)
        for gid, since in starting.items():
            if now - since > self.start_timeout:
                raise StageTimeout(f"generator start: restarted or added generator {gid} not ready within "
                                   f"{self.start_timeout:.0f}s")
        self._advance(now)
        for i, (spec, p) in enumerate(zip(self.specs, self.processes)):
            if p.exitcode is None or not self._restart_wanted(spec.generator_id):
                continue
            if self._stopping.is_set():
                raise GeneratorFailed(f"generator {spec.generator_id} ({spec.device}) exited with code {p.exitcode} "
                                      f"while the run was stopping; not restarted. Last error:\n"
                                      f"{self._errors.get(spec.generator_id) or '(none reported)'}{see_log(spec)}")
            self._restart(i, f"exited with code {p.exitcode}")

    def _restart(self, i: int, reason: str) -> None:
        spec = self.specs[i]
        gid = spec.generator_id
        if self.restarts[gid] >= self.max_restarts:
            deadline = time.monotonic() + 2.0  # its report was sent before it exited; the reader may not have it yet
            while gid not in self._errors and time.monotonic() < deadline:
                time.sleep(0.05)
            raise GeneratorFailed(f"generator {gid} ({spec.device}) {reason}; restarts exhausted "
                                  f"({self.max_restarts}). Last error:\n{self._errors.get(gid) or '(none reported)'}"
                                  f"{see_log(spec)}")
        self.restarts[gid] += 1
        logger.warning("generator %d (%s) %s; restarting (%d/%d) and re-issuing %d request(s)", gid, spec.device,
                       reason, self.restarts[gid], self.max_restarts, len(self._in_flight[gid]))
        stop_process(self.processes[i], 5.0)
        self.inboxes[i].cancel_join_thread()
        self.outboxes[i].cancel_join_thread()
        inbox, outbox = self.launcher.queues()
        with self._lock:
            update = self._last_update
            version = update.version if update is not None else spec.initial_version
            self._incarnation[i] += 1  # the old outbox's forwarder stops; its messages still queued are stale
            self.inboxes[i], self.outboxes[i] = inbox, outbox
            self.processes[i] = self._process(spec, inbox, outbox)
            self._starting[gid] = time.monotonic()
            self.acks.reset(gid, spec.initial_version)
            if self.feeds is not None:  # a new group for the new process, joined before anything else
                self.feeds.open(gid, inbox)
            if update is not None:  # FIFO: the newest weights load before any re-issued request
                self.acks.sent(gid, version)
                self._queue_update(gid, update)
            self._restarted(gid, version)
            for request in sorted(self._in_flight[gid].values(), key=lambda r: (r.batch_id, r.chunk)):
                inbox.put(request)
        self.processes[i].start()
        self._forward(i)

    # ---- reader thread -----------------------------------------------------------------------------------
    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                i, incarnation, msg = self._merged.get(timeout=0.2)
            except queue.Empty:
                continue
            if msg.kind == "error":  # the process exits next; `check` restarts it
                with self._lock:
                    self._errors[msg.generator_id] = msg.message
                continue
            if incarnation != self._incarnation[i]:  # from a process already replaced
                continue
            if msg.kind == "rollouts":
                with self._lock:  # a request answered twice (sent before a crash, then re-issued) counts once
                    fresh = self._in_flight[msg.generator_id].pop((msg.batch_id, msg.chunk), None) is not None
                    if fresh:
                        count, oldest = self.answered.get(msg.generator_id, [0, msg.policy_version])
                        self.answered[msg.generator_id] = [count + 1, min(oldest, msg.policy_version)]
                if fresh:
                    self.on_rollouts(msg)
                    with self._lock:
                        self.scheduling.answered(msg, self)
                continue
            if msg.kind == "weights_loaded":
                self.acks.acknowledged(msg.generator_id, msg.version, msg.seconds, msg.busy_seconds)
                continue
            if msg.kind == "ready":
                gid = msg.generator_id
                self._placed(msg)
                with self._lock:
                    self._starting.pop(gid, None)
                    self._ready(gid)
                continue
            with self._lock:
                taken = self.scheduling.message(msg, self)
            if not taken:
                logger.warning("generator %d sent a message of unknown kind %r; ignored", msg.generator_id, msg.kind)
