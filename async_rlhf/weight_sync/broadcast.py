"""Weights over a torch.distributed group of their own: learner rank 0 broadcasts, generators receive.

The group is *not* the learners' default group. Learner rank 0 and every generator (each of its vLLM workers, for
tensor-parallel engines) form a separate, stateless one: rank 0 opens a `TCPStore` on a socket it bound itself,
and every member builds a `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL` (GPU) on that store directly, without
`init_process_group`. So it never touches the learners' collectives, and the CPU and GPU paths are the same code
with another backend (vLLM's `StatelessProcessGroup` would do the rendezvous too, but it moves objects through the
store with pickle; this module never unpickles anything).

Protocol, per version: `publish(state, version)` returns a `WeightUpdate` carrying every tensor's name, dtype and
shape (plain strings and ints, sent to the generators as JSON), and queues the tensors for a sender thread, which
broadcasts them one by one from rank 0 in that order. A generator that reads the `WeightUpdate` allocates one
buffer per entry and receives into it (`receive_weights`), so nothing but raw tensor bytes ever comes off the
group, into buffers whose size the authenticated control message fixed.

Why a sender thread: a broadcast completes only once every generator takes part, and a generator takes part only
when it reaches the update in its FIFO inbox, possibly after finishing a batch. The learner must not wait for
that (it would lose the overlap that `max_staleness` buys), so rank 0 hands the sender thread the CPU copy that
`gather_full_state` already made (never live parameters) and goes on training.

Guarantees: versions are sent in the order published, each tensor once, in `WeightUpdate.names` order. Every
collective is bounded by `timeout` (the group's own timeout); a failure or timeout in the sender thread is kept
and raised by `check()` (which the pipeline polls while it waits) naming the stage and version.

Ports: the store listens on `host:port` (port 0: any free one); gloo opens one more ephemeral port per peer on the
same address, NCCL its own sockets (`NCCL_SOCKET_IFNAME`). Neither torch.distributed nor NCCL authenticates
peers: bind to loopback or a private network (see docs/architecture.md, "Remote generators").
"""

from __future__ import annotations

import datetime
import logging
import math
import queue
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from async_rlhf.types import WeightUpdate
from async_rlhf.errors import WeightTransportError

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
# dtype names a weight update may carry: parsed from JSON with this table, never with getattr on torch
DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}


class WeightBroadcastError(WeightTransportError):
    """The weight broadcast failed or timed out; the message names the stage and version."""


@dataclass(frozen=True)
class GroupInfo:
    """What a member needs to join the group (crosses the network as JSON; validated by `from_dict`)."""

    host: str
    port: int
    rank: int  # this member's first rank (a tensor-parallel engine's workers take rank, rank + 1, ...)
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout: float  # seconds, for the rendezvous and for every collective
    prefix: str  # store key prefix, unique per run

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GroupInfo":
        expected = {"host": str, "port": int, "rank": int, "world_size": int, "backend": str, "timeout": (int, float),
                    "prefix": str}
        if not isinstance(d, dict) or set(d) != set(expected):
            raise ValueError(f"group info: expected keys {sorted(expected)}, got {sorted(d) if isinstance(d, dict) else d!r}")
        for key, kind in expected.items():
            if not isinstance(d[key], kind) or isinstance(d[key], bool):
                raise ValueError(f"group info: {key} has type {type(d[key]).__name__}")
        info = cls(**d)
        if not (math.isfinite(info.timeout) and info.timeout > 0):
            raise ValueError(f"group info: timeout must be a finite number of seconds > 0, got {info.timeout}")
        if info.backend not in BACKENDS or not 0 < info.port < 65536 or not 0 < info.rank < info.world_size:
            raise ValueError(f"group info out of range: {info}")
        return info


class WeightGroup:
    """One stateless process group; rank 0 is the sender. Not thread-safe: one thread uses it at a time."""

    def __init__(self, info: GroupInfo, rank: int, listen_socket: socket.socket | None = None):
        from torch.distributed import PrefixStore, TCPStore

        self.backend = info.backend
        self.rank = rank
        self.timeout = info.timeout
        td = datetime.timedelta(seconds=info.timeout)
        if rank == 0:  # the store listens on the socket we bound (loopback unless told otherwise), no port race
            self._store = TCPStore(info.host, info.port, world_size=info.world_size, is_master=True, timeout=td,
                                   wait_for_workers=False, master_listen_fd=listen_socket.detach())
        else:
            self._store = TCPStore(info.host, info.port, world_size=info.world_size, is_master=False, timeout=td,
                                   wait_for_workers=False)
        store = PrefixStore(info.prefix, self._store)
        if info.backend == "gloo":
            from torch.distributed.distributed_c10d import ProcessGroupGloo

            options = ProcessGroupGloo._Options()
            options._timeout = td
            # gloo's own listening sockets go on the same interface as the store, never on every interface
            options._devices = [ProcessGroupGloo.create_device(hostname=_local_address_towards(info.host, rank))]
            self._pg = ProcessGroupGloo(store, rank, info.world_size, options)
            self.device = torch.device("cpu")
        else:
            from torch.distributed.distributed_c10d import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options._timeout = td
            self._pg = ProcessGroupNCCL(store, rank, info.world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 into every member's `tensor` (same shape and dtype); returns when done."""
        from torch.distributed import BroadcastOptions

        options = BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        options.timeout = datetime.timedelta(seconds=self.timeout)
        self._pg.broadcast([tensor], options).wait()

    def close(self) -> None:
        try:
            self._pg.abort() if self.backend == "nccl" else self._pg.shutdown()
        except Exception:  # already broken (a peer left): nothing left to release
            pass


def _local_address_towards(host: str, rank: int) -> str:
    """The address of this machine's interface that reaches `host` (for rank 0, `host` itself)."""
    if rank == 0:
        return host
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]
    finally:
        probe.close()


def receive_weights(group: WeightGroup, update: WeightUpdate) -> Iterator[tuple[str, torch.Tensor]]:
    """Generator side: yield `(name, tensor)` for every entry of `update`, each received from rank 0 as it is asked
    for, so that at most one tensor waits outside the model. The buffers come from the update's dtypes and shapes;
    the caller must consume the whole iterator (rank 0 sends every tensor)."""
    check_update_metadata(update)
    for name, dtype, shape in zip(update.names, update.dtypes, update.shapes):
        tensor = torch.empty(shape, dtype=DTYPES[dtype], device=group.device)
        group.broadcast(tensor)
        yield name, tensor


def check_update_metadata(update: WeightUpdate) -> None:
    if not (len(update.names) == len(update.dtypes) == len(update.shapes)):
        raise ValueError(f"weight update v{update.version}: {len(update.names)} names, {len(update.dtypes)} dtypes, "
                         f"{len(update.shapes)} shapes")
    for name, dtype, shape in zip(update.names, update.dtypes, update.shapes):
        if dtype not in DTYPES:
            raise ValueError(f"weight update v{update.version}: {name} has dtype {dtype!r}, not one of {list(DTYPES)}")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ValueError(f"weight update v{update.version}: {name} has shape {shape!r}")


class BroadcastWeightTransport:
    """Learner rank 0's end of the group. `listen` binds the store, `open` forms the group once every member is
    joining, `publish` queues a version for the sender thread; `check` raises a sender failure; `close` ends it."""

    name = "broadcast"

    def __init__(self, backend: str = "gloo", timeout: float = 300.0):
        if backend not in BACKENDS:
            raise ValueError(f"broadcast backend {backend!r} is not one of {BACKENDS}")
        self.backend = backend
        self.timeout = timeout
        self.prefix = f"async_rlhf/{secrets.token_hex(8)}/"
        self.host = ""
        self.port = 0
        self._socket: socket.socket | None = None
        self._group: WeightGroup | None = None
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._sender: threading.Thread | None = None
        self.send_seconds = 0.0  # time the sender thread spent broadcasting, summed over versions
        self.sent_versions: list[int] = []

    def listen(self, host: str, port: int = 0) -> tuple[str, int]:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        self._socket = sock
        self.host, self.port = host, sock.getsockname()[1]
        return self.host, self.port

    def member_info(self, rank: int, world_size: int) -> GroupInfo:
        return GroupInfo(host=self.host, port=self.port, rank=rank, world_size=world_size, backend=self.backend,
                         timeout=self.timeout, prefix=self.prefix)

    def open(self, world_size: int) -> None:
        """Blocks until every member has joined (at most `timeout`): call it while the members are joining."""
        if self._socket is None:
            raise RuntimeError("call listen() before open()")
        info = self.member_info(0, world_size)
        try:
            self._group = WeightGroup(info, rank=0, listen_socket=self._socket)
        except Exception as exc:
            raise WeightBroadcastError(f"weight sync: the broadcast group ({world_size} members, {self.backend}, "
                                       f"{self.host}:{self.port}) did not form within {self.timeout:.0f}s: {exc}") from exc
        self._socket = None  # the store owns it now
        self._sender = threading.Thread(target=self._send_loop, name="async_rlhf-weight-broadcast", daemon=True)
        self._sender.start()

    def publish(self, state: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        """Queue `state` (CPU tensors that nobody else mutates) for broadcast; returns the update to send."""
        if self._group is None:
            raise RuntimeError("the broadcast group is not open")
        self.check()
        names = list(state)
        update = WeightUpdate(version=version, transport="broadcast", names=names,
                              dtypes=[str(t.dtype).removeprefix("torch.") for t in state.values()],
                              shapes=[list(t.shape) for t in state.values()],
                              num_bytes=sum(t.numel() * t.element_size() for t in state.values()))
        check_update_metadata(update)
        self._queue.put((version, list(state.values())))
        return update

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            version, tensors = item
            t0 = time.perf_counter()
            try:
                for tensor in tensors:
                    self._group.broadcast(tensor.to(self._group.device).contiguous())
                if self._group.device.type == "cuda":
                    torch.cuda.synchronize(self._group.device)
            except BaseException as exc:  # kept for check(); the generators report their side themselves
                self._error = WeightBroadcastError(
                    f"weight sync: broadcasting weights v{version} failed or timed out ({self.timeout:.0f}s; a "
                    f"generator that is still busy sampling joins only when it reaches the update): {exc}")
                return
            self.send_seconds += time.perf_counter() - t0
            self.sent_versions.append(version)

    def wait_sent(self, version: int, timeout: float) -> None:
        """Block until `version` is fully broadcast (benchmarks and tests; training never waits for this)."""
        deadline = time.monotonic() + timeout
        while version not in self.sent_versions:
            self.check()
            if time.monotonic() > deadline:
                raise WeightBroadcastError(f"weight sync: weights v{version} not broadcast within {timeout:.0f}s")
            time.sleep(0.001)

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def release(self, version: int) -> None:
        """Nothing to free: a version's tensors are dropped once sent."""

    def stats(self) -> dict[str, float]:
        return {"sync/broadcast_seconds": self.send_seconds}  # the sender thread's time, off the learner's path

    def close(self) -> None:
        if self._sender is not None and self._sender.is_alive():
            self._queue.put(None)
            self._sender.join(5.0)  # a sender stuck in a collective is a daemon; aborting the group frees it
        if self._group is not None:
            self._group.close()
            self._group = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
