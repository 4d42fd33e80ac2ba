"""Generators that run elsewhere: the trainer's side of `generation/server.py`. Lives on learner rank 0.

`RemoteGeneratorPool` implements `pool_protocol.GeneratorPoolProtocol`, like `GeneratorPool`, so the pipeline, the staleness queue
and the admission rule work unchanged: a server answers requests in the order sent and tags every rollout with
the version it had loaded, exactly like a local generator process. Weights go by `BroadcastWeightTransport`: the
pool asks every server to join the group that rank 0 opens, and the first update it sends is the starting policy
(read from the directory the local generators would have started from), so a server needs no copy of it.

Owns: one TCP connection per server, each with a writer thread (the learner only enqueues, so a slow network
never blocks a training step) and a reader thread (rollouts -> `on_rollouts`, serialised by one lock since the
pipeline's reassembly is single-threaded; acknowledgements and errors are recorded here).

Guarantees and timeouts (every wait is bounded; each error names the stage and the server):
* `start`: connecting, the server's answer (its engine may still be starting), forming the broadcast group and
  loading the starting weights all finish within `start_timeout`, or "generator start: ..." is raised;
* a wrong or missing token, a busy server or a protocol mismatch is refused by the server, and `start` raises
  `GeneratorFailed` with the server's reason;
* `check` raises `StageTimeout` when a server has not acknowledged weights within `weight_sync_timeout`, and
  `GeneratorFailed` when a server reported an error, its connection closed or the broadcast to it failed (which
  it does at once when a member's socket closes, and after `weight_sync_timeout` otherwise). Remote servers are not restarted by
  the trainer (it did not start them, and the broadcast group cannot lose a member): restart the server and resume
  from the last checkpoint.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from async_rlhf.generation import wire
from async_rlhf.generation.pool_protocol import AckTracker, GeneratorFailed
from async_rlhf.generation.wire import parse_address
from async_rlhf.staleness_queue import StageTimeout
from async_rlhf.types import GenerationRequest, RolloutBatch, WeightUpdate
from async_rlhf.weight_sync.broadcast import BroadcastWeightTransport, WeightBroadcastError, state_from_model_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteSpec:
    generator_id: int
    address: str  # "host:port"

    @property
    def device(self) -> str:
        return f"server {self.address}"


class _Connection:
    """One trainer -> server connection. Synchronous `exchange` during start-up; afterwards two threads."""

    def __init__(self, spec: RemoteSpec, sock: socket.socket, token: str):
        self.spec = spec
        self.sock = sock
        self.token = token
        self.outbox: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.info: dict = {}

    def exchange(self, message: dict, expect: str, timeout: float, stage: str) -> dict:
        if message:
            self.send_now(message)
        self.sock.settimeout(max(timeout, 0.001))
        try:
            reply = wire.recv_frame(self.sock)
        except socket.timeout:
            raise StageTimeout(f"{stage}: generator server {self.spec.address} did not answer within "
                               f"{timeout:.0f}s") from None
        except (OSError, wire.ProtocolError) as exc:
            raise GeneratorFailed(f"{stage}: generator server {self.spec.address}: {exc}") from None
        if reply["kind"] == "error":
            raise GeneratorFailed(f"{stage}: generator server {self.spec.address} refused: {reply.get('message')}")
        if reply["kind"] != expect:
            raise GeneratorFailed(f"{stage}: generator server {self.spec.address} sent {reply['kind']!r}, "
                                  f"expected {expect!r}")
        return reply

    def send_now(self, message: dict) -> None:
        wire.send_frame(self.sock, {**message, "token": self.token})

    def start(self, on_frame: Callable[[dict], None], on_closed: Callable[[str], None]) -> None:
        self.sock.settimeout(None)
        self.threads = [
            threading.Thread(target=self._write, args=(on_closed,), daemon=True,
                             name=f"async_rlhf-remote-writer-{self.spec.generator_id}"),
            threading.Thread(target=self._read, args=(on_frame, on_closed), daemon=True,
                             name=f"async_rlhf-remote-reader-{self.spec.generator_id}"),
        ]
        for t in self.threads:
            t.start()

    def send(self, message: dict) -> None:
        self.outbox.put(message)

    def _write(self, on_closed) -> None:
        while True:
            message = self.outbox.get()
            if message is None:
                return
            try:
                self.send_now(message)
            except OSError as exc:
                on_closed(f"sending failed: {exc}")
                return

    def _read(self, on_frame, on_closed) -> None:
        while True:
            try:
                frame = wire.recv_frame(self.sock)
            except (OSError, wire.ProtocolError) as exc:
                on_closed(str(exc) or type(exc).__name__)
                return
            on_frame(frame)

    def close(self, bye: bool) -> None:
        if bye and self.threads:
            self.outbox.put({"kind": "bye"})
        self.outbox.put(None)
        if self.threads:
            self.threads[0].join(2.0)  # let the bye (and anything queued before it) go out
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for t in self.threads[1:]:
            t.join(2.0)


class RemoteGeneratorPool:
    def __init__(self, addresses: list[str], on_rollouts: Callable[[RolloutBatch], None],
                 transport: BroadcastWeightTransport, model_dir: str, initial_version: int, start_timeout: float,
                 weight_sync_timeout: float, token: str = "", broadcast_backend: str = "auto",
                 broadcast_host: str | None = None, broadcast_port: int = 0):
        self.specs = [RemoteSpec(i, a) for i, a in enumerate(addresses)]
        for spec in self.specs:
            parse_address(spec.address)
        self.on_rollouts = on_rollouts
        self.transport = transport
        self.model_dir = model_dir
        self.initial_version = initial_version
        self.start_timeout = start_timeout
        self.weight_sync_timeout = weight_sync_timeout
        self.token = token
        self.broadcast_backend = broadcast_backend
        self.broadcast_host = broadcast_host
        self.broadcast_port = broadcast_port
        self.connections: list[_Connection] = []
        self.num_generators = len(self.specs)
        self.acks = AckTracker([s.generator_id for s in self.specs], -1, weight_sync_timeout,  # -1: none loaded yet
                               describe=lambda g: f"generator server {g} ({self.specs[g].address})")
        self.restarts = {s.generator_id: 0 for s in self.specs}  # never restarted: kept for the pipeline's summary
        self.start_seconds = 0.0
        self._in_flight: dict[int, dict[tuple[int, int], GenerationRequest]] = {s.generator_id: {} for s in self.specs}
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()
        self._deliver = threading.Lock()
        self._stop = threading.Event()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout
        for spec in self.specs:
            conn = self._connect(spec, deadline)
            self.connections.append(conn)
            conn.info = wire.decode_reply(
                conn.exchange({"kind": "hello", "protocol": wire.PROTOCOL}, "ready", deadline - time.monotonic(),
                              "generator start"),
                "ready", {"backend": wire.STR, "device": wire.STR, "num_workers": wire.INT, "model": wire.STR})
            logger.info("generator server %s: %s", spec.address, conn.info)
        self._open_group(deadline)
        for conn in self.connections:
            gid = conn.spec.generator_id
            conn.start(lambda frame, gid=gid: self._on_frame(gid, frame), lambda why, gid=gid: self._on_closed(gid, why))
        # the starting policy: the trainer's, whatever the servers were started with
        self.send_weights(self.transport.publish(state_from_model_dir(self.model_dir), self.initial_version))
        while self.acks.min_loaded_version() < self.initial_version:
            self.check()
            if time.monotonic() > deadline:
                late = [s.address for s in self.specs
                        if self.acks.loaded_version[s.generator_id] < self.initial_version]
                raise StageTimeout(f"generator start: generator server(s) {late} did not load the starting weights "
                                   f"v{self.initial_version} within generator_start_timeout={self.start_timeout:.0f}s")
            time.sleep(0.05)
        self.start_seconds = time.monotonic() - t0

    def _connect(self, spec: RemoteSpec, deadline: float) -> _Connection:
        host, port = parse_address(spec.address)
        last = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                wire.keep_alive(sock)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return _Connection(spec, sock, self.token)
            except OSError as exc:  # not listening yet: the server may still be starting
                last = exc
                time.sleep(0.5)
        raise StageTimeout(f"generator start: could not connect to generator server {spec.address} within "
                           f"generator_start_timeout={self.start_timeout:.0f}s ({last})")

    def _open_group(self, deadline: float) -> None:
        """Form the broadcast group: rank 0 here, then each server's workers."""
        backend = self.broadcast_backend
        if backend == "auto":
            import torch

            on_gpu = torch.cuda.is_available() and all(c.info["device"] == "cuda" for c in self.connections)
            backend = "nccl" if on_gpu else "gloo"
        self.transport.backend = backend
        # the address the servers reach us at: by default the one our first connection leaves from
        host = self.broadcast_host or self.connections[0].sock.getsockname()[0]
        self.transport.listen(host, self.broadcast_port)
        world_size = 1 + sum(c.info["num_workers"] for c in self.connections)
        rank = 1
        for conn in self.connections:
            conn.send_now({"kind": "join_group", "group": self.transport.member_info(rank, world_size).to_dict()})
            rank += conn.info["num_workers"]
        try:
            self.transport.open(world_size)  # returns once every server's workers have joined
        except WeightBroadcastError as exc:
            reasons = []
            for conn in self.connections:  # a server that failed to join says why
                try:
                    conn.exchange({}, "group_joined", 1.0, "weight sync")
                except (StageTimeout, GeneratorFailed) as why:
                    reasons.append(str(why))
            raise GeneratorFailed(f"{exc}\n" + "\n".join(reasons)) from None
        for conn in self.connections:
            conn.exchange({}, "group_joined", max(1.0, deadline - time.monotonic()), "weight sync")
        logger.info("weight broadcast group formed: %d members over %s at %s:%d", world_size, backend,
                    self.transport.host, self.transport.port)

    def close(self, timeout: float = 20.0) -> None:
        """Let the servers finish loading the weights already sent (at most `timeout`), then say bye."""
        deadline = time.monotonic() + timeout
        while self.acks.waiting() and not self._failed and time.monotonic() < deadline:
            try:
                self.transport.check()
            except WeightBroadcastError:
                break
            time.sleep(0.05)
        self._stop.set()
        for conn in self.connections:
            conn.close(bye=True)
        self.connections = []

    # ---- messages --------------------------------------------------------------------------------------
    def send_weights(self, update: WeightUpdate) -> None:
        message = wire.encode_update(update)
        with self._lock:
            for conn in self.connections:
                self.acks.sent(conn.spec.generator_id, update.version)
                conn.send(message)

    def send_request(self, generator_id: int, request: GenerationRequest) -> None:
        with self._lock:
            self._in_flight[generator_id][(request.batch_id, request.chunk)] = request
            self.connections[generator_id].send(wire.encode_request(request))

    # ---- health --------------------------------------------------------------------------------------
    def begin_stop(self) -> None:
        """Nothing to do: remote servers are never restarted by the trainer."""

    def check(self) -> None:
        """Raise if a server failed or a weight update is overdue. Main thread only."""
        with self._lock:
            for gid, reason in self._failed.items():
                spec = self.specs[gid]
                raise GeneratorFailed(
                    f"generator server {gid} ({spec.address}) failed: {reason}\nRemote servers are not restarted by "
                    "the trainer: restart the server and resume from the last checkpoint.")
        try:
            self.transport.check()
        except WeightBroadcastError as exc:  # as a generator failure, so the pipeline handles it like any other
            raise GeneratorFailed(f"{exc}\n(generator servers in the group: "
                                  f"{', '.join(s.address for s in self.specs)})") from None
        self.acks.overdue()

    # ---- reader threads ----------------------------------------------------------------------------------
    def _on_frame(self, gid: int, frame: dict) -> None:
        kind = frame["kind"]
        try:
            if kind == "rollouts":
                key = (frame.get("batch_id"), frame.get("chunk"))
                with self._lock:
                    request = self._in_flight[gid].pop(key, None)
                if request is None:
                    raise wire.ProtocolError(f"rollouts for batch/chunk {key} that were not requested")
                batch = wire.decode_rollouts(frame, request, gid)
                with self._deliver:  # one reader per server; the pipeline's reassembly expects one caller at a time
                    self.on_rollouts(batch)
            elif kind == "weights_loaded":
                f = wire.decode_reply(frame, kind, {"version": wire.INT, "seconds": wire.FLOAT})
                self.acks.acknowledged(gid, f["version"], f["seconds"])
            elif kind == "error":
                self._fail(gid, f"reported an error: {frame.get('message')}")
            else:
                raise wire.ProtocolError(f"unexpected message kind {kind!r}")
        except wire.ProtocolError as exc:
            self._fail(gid, f"sent an invalid message: {exc}")

    def _on_closed(self, gid: int, why: str) -> None:
        if not self._stop.is_set():
            self._fail(gid, f"connection lost ({why})")

    def _fail(self, gid: int, reason: str) -> None:
        with self._lock:
            self._failed.setdefault(gid, reason)
