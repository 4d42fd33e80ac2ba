"""Generators as Ray actors (`generator_launcher='ray'`; Ray is an optional extra: requirements-ray.txt).

What changes against the default launcher (`processes.ProcessLauncher`) is only how a generator is started and reached:
* **placement and weights**: each generator is an actor asking Ray for a GPU (`cuda:*` entries of `generator_devices` /
  `generator_autoscale_devices`: the entry says "a GPU", Ray picks which, and the actor sees it as its only one) or
  for `generator_threads` CPUs (`cpu` entries). Where it may run follows how its weights arrive (`RayLauncher.plan`,
  decided once, before any actor starts):
  - the network transport (`network_feeds.py`: a gloo or NCCL group of its own per actor, joined through its inbox):
    anywhere in the cluster, by Ray's default scheduling (any node with the CPUs or GPU free). `weight_transport`
    'auto' picks it when the cluster has a node besides learner rank 0's (and the generators are vLLM);
  - shm (files in rank 0's `/dev/shm`, node-local) or CUDA IPC: pinned to learner rank 0's node (a hard
    node-affinity constraint), as on a one-node cluster, or with `weight_transport` 'shm' forced.
  A replacement (the pool restarts a dead generator by asking for a new actor) and an added generator
  (`generator_autoscale`) are placed by Ray the same way, and join a weight group of their own at the next version.
  Refused before any actor starts: generators that may land on another host while the weight group listens on a
  loopback `weight_sync_host`, or while version 0 is only a copy in rank 0's `shm_dir` (`plan`);
* **messages**: the actor runs the same serve loops as a generator process (`worker._serve`, `serve_loops.py`);
  the pool's inbox is a proxy whose `put` calls the actor's `send` method and its outbox one whose `get` calls
  `poll`. The actor is threaded (one thread serves, others take `send`/`poll` calls), and Ray does not keep the
  call order of a threaded actor, so every message carries a sequence number and the actor delivers them in order:
  the FIFO rule (weights before the requests queued after them) holds as with `multiprocessing` queues;
* **lifetime**: Ray ends a driver's actors when the driver exits, so a generator never outlives learner rank 0.
  A generator that returned (Shutdown, or its error report) is killed to free its CPUs or GPU. `close` shuts down
  Ray if this process started it.

The trainer still owns admission, versions and restarts (`generation/pool/local.py`); Ray owns where actors run. No cluster manager
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

from async_rlhf.config.checks import is_loopback
from async_rlhf.errors import ConfigError


def make_launcher(args, model_path: str = ""):
    """The launcher `args.generator_launcher` names, its placement planned (`RayLauncher.plan`); None for the default
    (`processes.ProcessLauncher`)."""
    if args.generator_launcher != "ray":
        return None
    launcher = RayLauncher()
    try:
        launcher.plan(args, model_path)
    except BaseException:
        launcher.close()
        raise
    return launcher


def placement(args, here: str, others: dict[str, str], model_path: str = "") -> str:
    """How weights reach Ray actors, 'shm' or 'ipc' (pinned to learner rank 0's node, at address `here`) or 'network'
    (anywhere), for a cluster whose other alive nodes are `others` (node id -> address); a ConfigError for a setting
    that cannot work there (see the module docstring)."""
    weights = args.local_weight_transport  # 'shm' or 'ipc' under auto, else the one forced
    if args.weight_transport == "auto" and weights == "shm" and others and args.generator_backend == "vllm":
        weights = "network"
    if weights != "network":
        return weights
    hosts = sorted({ip for ip in others.values() if ip != here})
    if hosts and is_loopback(args.weight_sync_host):
        raise ConfigError(
            f"weight_sync_host: {args.weight_sync_host!r} is a loopback address, but generator_launcher='ray' may "
            f"place generators on other hosts of the Ray cluster ({', '.join(hosts)}), which cannot reach it: pass "
            f"--weight_sync_host {here} --allow_remote true (a private network), or --weight_transport shm to keep "
            "the generators on this node")
    shm = os.path.realpath(args.shm_dir) + os.sep
    if model_path and os.path.realpath(model_path).startswith(shm):
        raise ConfigError(
            f"generator_launcher: 'ray' may place generators on other nodes, which load version 0 from {model_path}, "
            "a copy in learner rank 0's shm_dir that they cannot read (the policy has no saved directory of its own, "
            "or is a LoRA policy whose merged weights are copied): save the policy and pass its directory, or "
            "--weight_transport shm to keep the generators on this node")
    return weights


def check_room(args, weights: str, home: dict[str, float], others: dict[str, dict[str, float]]) -> None:
    """A ConfigError unless the Ray nodes the generators may use have room for them: `home` is the total resources of
    learner rank 0's node, `others` those of the other alive nodes (node id -> resources). Ray would otherwise keep an
    actor it cannot place pending, and the run would wait for it until `generator_start_timeout`."""
    needs = [("GPU", 1.0) if d.startswith("cuda") else ("CPU", float(args.generator_threads))
             for d in args.generator_devices]
    nodes = [home] + (list(others.values()) if weights == "network" else [])
    for kind in ("GPU", "CPU"):
        wanted = [n for k, n in needs if k == kind]
        if not wanted:
            continue
        free = [node.get(kind, 0.0) for node in nodes]
        if sum(wanted) <= sum(free) and max(wanted) <= max(free):
            continue
        have = ", ".join(f"{f:g}" for f in free)
        if weights == "network":
            where = f"the Ray cluster's nodes have {have} {kind}(s)"
        else:
            where = (f"learner rank 0's Ray node has {have} {kind}(s) (generators whose weights arrive by {weights} "
                     "stay on it" + ("; generator_backend 'transformers' loads only shm updates: use vllm for the "
                                     "network" if args.generator_backend == "transformers" and others else "") + ")")
        per = f"{wanted[0]:g} {kind}{'s' if wanted[0] != 1 else ''} each" if kind == "CPU" else "1 GPU each"
        raise ConfigError(f"generator_devices: {len(wanted)} generator(s) need {sum(wanted):g} {kind}(s) ({per}), "
                          f"but {where}: start Ray nodes with room "
                          "for them, or ask for fewer (generator_devices, generator_threads)")


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

    def __init__(self, spec, home_node: str = ""):
        import ray

        from async_rlhf.generation.engine.process_log import route_output

        self.spec = spec
        self.inbox = _OrderedInbox()
        self.outbox: queue.Queue = queue.Queue()
        node = ray.get_runtime_context().get_node_id()
        self.where = f"Ray node {node[:8]} at {ray.util.get_node_ip_address()}" + (
            " (learner rank 0's node)" if node == home_node else " (not learner rank 0's node)")
        route_output(spec.log_path, f"generator-{spec.generator_id}")

    def serve(self) -> bool:
        """Until Shutdown (True) or an error, reported on the outbox first (False); the engine is closed after."""
        from async_rlhf.generation.engine.worker import _serve

        spec = self.spec
        if spec.device.startswith("cuda"):  # the GPU Ray gave this actor, by the index it has in this process
            import dataclasses

            spec = dataclasses.replace(spec, device=f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', '0')}")
        return _serve(spec, self.inbox, self.outbox, self.where)

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
        self._gid = -1
        self._ready: collections.deque = collections.deque()
        self._closed = ""

    def bind(self, actor, generator_id: int) -> None:
        self._actor, self._gid, self._closed = actor, generator_id, ""

    def get(self, timeout: float):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        from async_rlhf.types import GeneratorError

        if self._closed:
            raise EOFError(self._closed)
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
            except RayError as exc:  # never ran (Ray could not place it): the pool's error report, then closed
                self._closed = f"{type(exc).__name__}: {exc}"
                return GeneratorError(self._gid, f"Ray could not run generator {self._gid}'s actor: {self._closed}")
        if not self._ready:
            raise queue.Empty
        return self._ready.popleft()

    def cancel_join_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class RayGenerator:
    """One generator actor, with the part of `multiprocessing.Process`'s surface the pool uses."""

    def __init__(self, actor_class, spec, inbox: _Inbox, outbox: _Outbox, node_id: str, anywhere: bool):
        self.spec, self.inbox, self.outbox = spec, inbox, outbox
        self._actor_class, self._node_id, self._anywhere = actor_class, node_id, anywhere
        self.actor = None
        self._done = None  # the `serve` call's result
        self._exitcode: int | None = None
        self.pid: int | None = None  # not an OS pid: set once started, as the pool checks `pid is None` for that

    def start(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        gpu = self.spec.device.startswith("cuda")
        where = "DEFAULT" if self._anywhere else NodeAffinitySchedulingStrategy(self._node_id, soft=False)
        self.actor = self._actor_class.options(
            num_gpus=1 if gpu else 0, num_cpus=0 if gpu else self.spec.threads, max_concurrency=4, max_restarts=0,
            name=None, scheduling_strategy=where,
        ).remote(self.spec, self._node_id)
        self._done = self.actor.serve.remote()
        self.inbox.bind(self.actor)
        self.outbox.bind(self.actor, self.spec.generator_id)
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


RAY_CONNECT_TIMEOUT = 10.0  # seconds for RAY_ADDRESS's head to accept a connection before ray.init is called


def check_ray_address(address: str, timeout: float = RAY_CONNECT_TIMEOUT) -> None:
    """Refuse a `RAY_ADDRESS` of the form host:port whose head does not accept a connection within `timeout`
    seconds: `ray.init` keeps retrying it (over 2 minutes when tried here), printing a warning every few seconds. 'auto', 'local' and
    'ray://' (client) addresses are left to Ray."""
    import socket

    host, _, port = address.strip().rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ConfigError(
            f"generator_launcher='ray': RAY_ADDRESS={address!r} did not accept a connection within {timeout:.0f} s "
            f"({type(e).__name__}: {e}); start the cluster's head there (`ray start --head --port {port}`), point "
            f"RAY_ADDRESS at a running head, or unset it to start a local Ray") from None


class RayLauncher:
    """Starts generators as Ray actors: on this node, or anywhere in the cluster once `plan` chose the network for
    their weights. Connects to `RAY_ADDRESS`'s cluster, else starts a local Ray."""

    def __init__(self):
        import ray

        self._started = not ray.is_initialized()
        if self._started:
            check_ray_address(os.environ.get("RAY_ADDRESS", ""))
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
        self._node_id = ray.get_runtime_context().get_node_id()
        self._actor_class = ray.remote(GeneratorActor)
        self.weights = "shm"  # how weights reach the actors: 'shm' or 'ipc' (this node), 'network' (anywhere)
        self.anywhere = False

    def plan(self, args, model_path: str = "") -> str:
        """Choose how weights reach the actors, and so where they may run (`placement`), and check they fit there
        (`check_room`)."""
        import ray

        nodes = {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}
        others = {i: n for i, n in nodes.items() if i != self._node_id}
        self.weights = placement(args, ray.util.get_node_ip_address(),
                                 {i: n["NodeManagerAddress"] for i, n in others.items()}, model_path)
        self.anywhere = self.weights == "network"
        check_room(args, self.weights, nodes[self._node_id]["Resources"],
                   {i: n["Resources"] for i, n in others.items()})
        return self.weights

    def queues(self):
        return _Inbox(), _Outbox()

    def process(self, spec, inbox, outbox) -> RayGenerator:
        return RayGenerator(self._actor_class, spec, inbox, outbox, self._node_id, self.anywhere)

    def close(self) -> None:
        import ray

        if self._started and ray.is_initialized():
            ray.shutdown()
