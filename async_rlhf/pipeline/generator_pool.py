"""The boundary between the pipeline and its generators: what every generator pool offers, and the bookkeeping of
weight acknowledgements that every pool shares.

A pool lives on learner rank 0 and is driven by `pipeline/rollout_pipeline.py` from the main thread (`start`, `send_request`,
`send_weights`, `check`, `close`), while a reader thread of the pool's own hands finished rollouts to the
`on_rollouts` callback it was built with. Two pools implement it: `GeneratorPool` (generator processes on this
machine, `generation/pool/local.py`) and `HTTPGeneratorPool` (vLLM servers started separately, `generation/pool/http_pool.py`; its "reader" is an
event-loop thread).

Guarantees every pool gives the pipeline:
* each generator receives its messages in the order sent, and tags every rollout with the version of the weights
  it had loaded when it sampled (so a request sent after `send_weights(v)` is sampled with version >= v);
* `start` returns once every generator is up, or raises within the start timeout naming the generator;
* `active_generators()` lists the ids requests may go to; a pool of fixed size returns every id;
* `check` raises `GeneratorFailed` when a generator failed for good, and `StageTimeout` when a generator has not
  acknowledged a weight update within `weight_sync_timeout` (the `AckTracker` below, the same rule for both);
* after `begin_stop` (the run is stopping: SIGINT/SIGTERM), no generator is restarted;
* `close` is bounded in time and leaves nothing running that the pool started.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

from async_rlhf.errors import StageTimeout
from async_rlhf.types import GenerationRequest, RolloutBatch, WeightUpdate


class GeneratorPoolProtocol(Protocol):
    num_generators: int
    acks: AckTracker
    restarts: dict[int, int]  # generator id -> restarts so far
    places: dict[int, dict]  # generator id -> {device, where, weights}: where it runs and how its weights arrive
    start_seconds: float  # time `start` took (from the spawn, for processes spawned early)
    start_wait_seconds: float  # of it, what the caller of `start` waited

    def start(self) -> None: ...

    def send_request(self, generator_id: int, request: GenerationRequest) -> None: ...

    def active_generators(self) -> list[int]: ...  # ids that take requests now (elastic pools change them)

    def send_weights(self, update: WeightUpdate) -> None: ...

    def check(self) -> None: ...

    def begin_stop(self) -> None: ...

    def close(self, timeout: float = 20.0) -> None: ...


class RequestBook(Protocol):
    """What a generator schedule may use of a local pool: its requests in flight, and its generators' inboxes. Used
    only from the pool's reader thread with the pool's lock held (the schedule's calls below)."""

    def in_flight(self) -> dict[int, dict[tuple[int, int], object]]: ...  # generator -> {(batch, chunk): request}

    def starting(self) -> set[int]: ...  # generators (re)starting now: their engines are not up

    def put(self, generator_id: int, message) -> None: ...  # into its inbox, in order with everything sent to it

    # request `key` leaves `source` for `target` (its in-flight table and inbox): False if `source` no longer held it
    def move(self, key: tuple[int, int], source: int, target: int, request) -> bool: ...


class GeneratorScheduling(Protocol):
    """How a run's generators are scheduled beyond sending each request to one of them: requests handed between
    generators, generators added or retired. The default, and who calls what: `generation/pool/scheduling.py`."""

    def answered(self, rollouts: RolloutBatch, requests: RequestBook) -> None: ...  # a request's first answer

    def message(self, message, requests: RequestBook) -> bool: ...  # a generator's message of a kind the pool
    # does not know: True if the schedule took it

    def after_step(self, step: int, wait_seconds: float, queued_version: int) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def summary(self) -> dict[str, dict]: ...  # {section of the run summary: its content}; {}: nothing to add


# (on_rollouts, initial_version) -> (weight transport, pool not started yet, generator schedule): built by the trainer
# from `generation/pool/choice.make_pool`, so that the pipeline never imports the pools it drives
MakePool = Callable[[Callable[[RolloutBatch], None], int], tuple[object, GeneratorPoolProtocol, GeneratorScheduling]]


class AckTracker:
    """Which weights each generator has loaded, and which updates it has not acknowledged yet. Thread-safe: the
    main thread records what it sends and checks deadlines; a reader thread records acknowledgements.

    `loaded_version[g]` is the newest version generator g acknowledged (`initial_version` until then).
    `overdue` raises `StageTimeout` for an update that waits longer than `timeout` seconds, naming the generator
    with `describe(g)`; generators listed in `exempt` (restarting ones, which reload the weights anyway) are skipped.
    """

    def __init__(self, generator_ids: list[int], initial_version: int, timeout: float,
                 describe: Callable[[int], str] = lambda g: f"generator {g}"):
        self.timeout = timeout
        self.describe = describe
        self.loaded_version = {g: initial_version for g in generator_ids}
        self.load_seconds: list[float] = []  # one entry per acknowledged update
        self.busy_seconds = {g: 0.0 for g in generator_ids}  # each generator's sampling time, as of its last ack
        self._pending: dict[tuple[int, int], float] = {}  # (generator, version) -> time sent
        self._lock = threading.Lock()

    def sent(self, generator_id: int, version: int) -> None:
        with self._lock:
            self._pending[(generator_id, version)] = time.monotonic()

    def acknowledged(self, generator_id: int, version: int, seconds: float, busy_seconds: float | None = None) -> None:
        with self._lock:
            if busy_seconds is not None:
                self.busy_seconds[generator_id] = busy_seconds
            self._pending.pop((generator_id, version), None)
            self.loaded_version[generator_id] = version
            self.load_seconds.append(seconds)

    def reset(self, generator_id: int, version: int) -> None:
        """A generator restarted from `version`'s weights: its earlier updates will never be acknowledged."""
        with self._lock:
            self._pending = {k: v for k, v in self._pending.items() if k[0] != generator_id}
            self.loaded_version[generator_id] = version

    def add(self, generator_id: int, version: int) -> None:
        """A generator joined the pool, starting from `version`'s weights."""
        with self._lock:
            self.loaded_version[generator_id] = version
            self.busy_seconds.setdefault(generator_id, 0.0)

    def remove(self, generator_id: int) -> None:
        """A generator left the pool: nothing more is awaited from it (its busy seconds stay counted)."""
        with self._lock:
            self._pending = {k: v for k, v in self._pending.items() if k[0] != generator_id}
            self.loaded_version.pop(generator_id, None)

    def waiting(self) -> int:
        """How many (generator, update) acknowledgements are outstanding."""
        with self._lock:
            return len(self._pending)

    def pending(self) -> dict[int, list[int]]:
        """Generator id -> the versions sent to it and not acknowledged yet (ascending); only generators with some."""
        out: dict[int, list[int]] = {}
        with self._lock:
            for g, v in sorted(self._pending):
                out.setdefault(g, []).append(v)
        return out

    def min_loaded_version(self) -> int:
        with self._lock:
            return min(self.loaded_version.values())

    def overdue(self, exempt=()) -> None:
        now = time.monotonic()
        with self._lock:
            late = [(g, v) for (g, v), sent in self._pending.items() if now - sent > self.timeout and g not in exempt]
        if late:
            g, v = min(late)
            raise StageTimeout(f"weight sync: {self.describe(g)} did not acknowledge weights v{v} within "
                               f"{self.timeout:.0f}s (raise weight_sync_timeout if loading, or the batch it was "
                               "sampling first, is slow)")
