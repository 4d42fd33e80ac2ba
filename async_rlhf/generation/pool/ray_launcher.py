"""Generators as Ray actors (`generator_launcher='ray'`; Ray is an optional extra: requirements-ray.txt).

What changes against the default launcher (`processes.ProcessLauncher`) is only how a generator is started and reached:
* **placement**: each generator is an actor asking Ray for a GPU (`cuda:*` entries of `generator_devices` /
  `generator_autoscale_devices`: the entry says "a GPU", Ray picks which, and the actor sees it as its only one) or
  for `generator_threads` CPUs (`cpu` entries). Ray schedules it, and a replacement (the pool restarts a dead
  generator by asking for a new actor) is placed by Ray again. Our shared-memory weight transport (`/dev/shm` files
  read by the generator) is node-local, so actors are pinned to learner rank 0's node (a hard node-affinity
  constraint): what crosses to an actor is the messages (requests, rollouts, `WeightUpdate`s naming shm files),
  never the weights. Generators on other nodes need a weight transport that crosses machines (not written yet);
* **messages**: the actor runs the same serve loops as a generator process (`worker._serve`, `serve_loops.py`);
  the pool's inbox is a proxy whose `put` calls the actor's `send` method and its outbox one whose `get` calls
  `poll`. The actor is threaded (one thread serves, others take `send`/`poll` calls), and Ray does not keep the
  call order of a threaded actor, so every message carries a sequence number and the actor delivers them in order:
  the FIFO rule (weights before the requests queued after them) holds as with `multiprocessing` queues;
* **lifetime**: Ray ends a driver's actors when the driver exits, so a generator never outlives learner rank 0.
  A generator that returned (Shutdown, or its error report) is killed to free its CPUs or GPU. `close` shuts down
  Ray if this process started it.

The trainer still owns admission, versions and restarts (`pool.py`); Ray owns where actors run. No cluster manager
of ours: to use a cluster, start Ray there (`ray start --head`, `ray start --address ...`) and set `RAY_ADDRESS`.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import queue
import threading
import time

def make_launcher(args):
    """The launcher `args.generator_launcher` names; None for the default (`processes.ProcessLauncher`)."""
    if args.generator_launcher != "ray":
        return None
    return RayLauncher()


class _OrderedInbox:
    """Inside the actor: messages arrive numbered, maybe out of order, and are handed out in number order."""

    def __init__(self):
        self._heap: list = []
        self._next = 0
        self._cond = threading.Condition()

    def deliver(self, seq: int, msg) -> None:
        with self._cond:
            heapq.heappush(self._heap, (seq, msg))
            self._cond.notify_all()

    def get(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not (self._heap and self._heap[0][0] == self._next):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Empty
                self._cond.wait(left)
            self._next += 1
            return heapq.heappop(self._heap)[1]

    def get_nowait(self):
        return self.get(timeout=0)


class GeneratorActor:
    """The Ray actor: one generator (engine + serve loop) in a Ray worker process."""

    def __init__(self, spec):
        from async_rlhf.generation.engine.process_log import route_output

        self.spec = spec
        self.inbox = _OrderedInbox()
        self.outbox: queue.Queue = queue.Queue()
        route_output(spec.log_path, f"generator-{spec.generator_id}")

    def serve(self) -> bool:
        """Until Shutdown (True) or an error, reported on the outbox first (False); the engine is closed after."""
        from async_rlhf.generation.engine.worker import _serve

        spec = self.spec
        if spec.device.startswith("cuda"):  # the GPU Ray gave this actor, by the index it has in this process
            import dataclasses

            spec = dataclasses.replace(spec, device=f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}")
        return _serve(spec, self.inbox, self.outbox)

    def send(self, seq: int, msg) -> None:
        self.inbox.deliver(seq, msg)

    def poll(self, timeout: float) -> list:
        """Whatever the outbox holds, waiting at most `timeout` for the first message."""
        try:
            out = [self.outbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                return out


class _Inbox:
    """Learner side of a generator's inbox: numbered `send` calls; held back until the actor exists."""

    def __init__(self):
        self._actor = None
        self._held: list = []
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def bind(self, actor) -> None:
        with self._lock:
            self._actor = actor
            for seq, msg in self._held:
                actor.send.remote(seq, msg)
            self._held.clear()

    def put(self, msg) -> None:
        with self._lock:
            seq = next(self._seq)
            if self._actor is None:
                self._held.append((seq, msg))
            else:
                self._actor.send.remote(seq, msg)

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Outbox:
    """Learner side of a generator's outbox: `get` polls the actor; a dead actor reads as a closed queue."""

    def __init__(self):
        self._actor = None
        self._ready: collections.deque = collections.deque()

    def bind(self, actor) -> None:
        self._actor = actor

    def get(self, timeout: float):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if not self._ready:
            if self._actor is None:
                time.sleep(timeout)
                raise queue.Empty
            try:
                self._ready.extend(ray.get(self._actor.poll.remote(timeout), timeout=timeout + 30.0))
            except GetTimeoutError:  # an OSError: caught first, it means "nothing yet", not "closed"
                raise queue.Empty from None
            except RayActorError as exc:
                raise EOFError(str(exc)) from None
        if not self._ready:
            raise queue.Empty
        return self._ready.popleft()

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class RayGenerator:
    """One generator actor, with the part of `multiprocessing.Process`'s surface the pool uses."""

    def __init__(self, actor_class, spec, inbox: _Inbox, outbox: _Outbox, node_id: str):
        self.spec, self.inbox, self.outbox = spec, inbox, outbox
        self._actor_class, self._node_id = actor_class, node_id
        self.actor = None
        self._done = None  # the `serve` call's result
        self._exitcode: int | None = None
        self.pid: int | None = None  # not an OS pid: set once started, as the pool checks `pid is None` for that

    def start(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        gpu = self.spec.device.startswith("cuda")
        self.actor = self._actor_class.options(
            num_gpus=1 if gpu else 0, num_cpus=0 if gpu else self.spec.threads, max_concurrency=4, max_restarts=0,
            name=None, scheduling_strategy=NodeAffinitySchedulingStrategy(self._node_id, soft=False),
        ).remote(self.spec)
        self._done = self.actor.serve.remote()
        self.inbox.bind(self.actor)
        self.outbox.bind(self.actor)
        self.pid = 0

    @property
    def exitcode(self) -> int | None:
        """None while the actor serves; 0 once `serve` returned after Shutdown; 1 after an error or its death."""
        import ray

        if self._exitcode is None and self._done is not None:
            ready, _ = ray.wait([self._done], timeout=0)
            if ready:
                try:
                    self._exitcode = 0 if ray.get(ready[0]) else 1
                except Exception:
                    self._exitcode = 1
                ray.kill(self.actor, no_restart=True)  # free its CPUs or GPU
        return self._exitcode

    def is_alive(self) -> bool:
        return self._done is not None and self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        import ray

        if self._done is not None:
            ray.wait([self._done], timeout=timeout)
            self.exitcode  # noqa: B018 (records the exit and frees the actor if it ended)

    def kill(self) -> None:
        import ray

        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)


class RayLauncher:
    """Starts generators as Ray actors on this node; connects to `RAY_ADDRESS`'s cluster, else starts a local Ray."""

    def __init__(self):
        import ray

        self._started = not ray.is_initialized()
        if self._started:
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
        self._node_id = ray.get_runtime_context().get_node_id()
        self._actor_class = ray.remote(GeneratorActor)

    def queues(self):
        return _Inbox(), _Outbox()

    def process(self, spec, inbox, outbox) -> RayGenerator:
        return RayGenerator(self._actor_class, spec, inbox, outbox, self._node_id)

    def close(self) -> None:
        import ray

        if self._started and ray.is_initialized():
            ray.shutdown()
