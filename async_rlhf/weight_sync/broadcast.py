"""The wire of the "network" weight transport: a gloo group of its own, a vote, then the weights in packed buckets.

This is the one broadcast implementation in the project. `vllm_gloo_engine.py` drives it on both sides (learner
rank 0 sends, every worker of a vLLM generator receives), as vLLM's own `nccl` engine drives PyNccl on GPUs.

The group. Learner rank 0 and the workers of ONE generator form a stateless group of their own: rank 0 opens a
`TCPStore` on a socket it bound itself, every member builds a `ProcessGroupGloo` on that store directly, without
`init_process_group`, so it never touches the learners' collectives. Nothing is unpickled: only raw tensor bytes come
off the group, into buffers whose sizes the control message fixed. The control message (`GroupInfo`, then per
version the names, dtypes and shapes) reaches a member through an authenticated channel (the server's bearer-token
route, or the generator process's own inbox); the group's store key prefix is a fresh random string in that message,
so a process that can reach the port but did not get the message finds nothing to join.

Why one group per generator and not one for all: generators reach an update at different times (each after the
requests queued before it, FIFO), restart, and come and go (`generator_autoscale`); gloo and NCCL groups cannot grow.
With a group each, a generator that joins or is restarted gets a new group at its start and receives the next
version sent after it, and a dead generator breaks only its own group. The cost: rank 0 sends the bytes once per
generator, which a gloo broadcast to several members does anyway (the root sends to each).

Per version: `vote` (an all-reduce of 1 = "I accept these names, dtypes and shapes", 0 = "I refuse"; the minimum
wins), then `send_packed` / `receive_packed`. A member that refuses says so before any weight bytes move, so every
member leaves the round at once and nothing loads: no member waits out the timeout for a peer that gave up.
Buckets: tensors in `names` order; a tensor of at least `SOLO_BYTES` travels alone, sent from its own memory, and
runs of smaller ones are packed (one copy), a bucket closed as soon as its bytes reach `bucket_bytes`. Both sides
compute the same plan from the same metadata (`bucket_plan`), so the boundaries never travel.

Guarantees: every collective (rendezvous included) is bounded by the group's `timeout`; a failure raises
`WeightBroadcastError` naming the stage; the group is then unusable and must be closed (the caller forms a new one).
Ports: the store listens on `host:port` (port 0: a free one); gloo opens one more port per member on the address of
the interface that reaches `host`. Neither torch.distributed nor gloo authenticates anyone: bind to loopback (the
default) or a private network; a non-loopback bind needs `allow_remote` (`listen`).
"""

from __future__ import annotations

import datetime
import math
import secrets
import socket
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

import torch

from async_rlhf.config.checks import is_loopback  # noqa: F401  (re-exported: the one loopback rule)
from async_rlhf.errors import WeightTransportError

# dtype names a weight update may carry: parsed with this table, never with getattr on torch
DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")}
DEFAULT_BUCKET_BYTES = 16 << 20  # the most small tensors packed into one collective
# a tensor this large travels alone, sent from its own memory: packing it would be one more copy, and on CPU the copy
# costs as much as gloo's send (benchmarks/weight_broadcast.py); what packing saves is per-collective latency, which
# only matters for the many small tensors (norms, biases)
SOLO_BYTES = 1 << 20


class WeightBroadcastError(WeightTransportError):
    """The weight broadcast failed, timed out or was refused; the message names the stage and version."""


@dataclass(frozen=True)
class GroupInfo:
    """What a member needs to join a group (crosses processes as JSON; validated by `from_dict`)."""

    host: str
    port: int
    rank: int  # this member's first rank (a tensor-parallel engine's workers take rank, rank + 1, ...)
    world_size: int
    timeout: float  # seconds, for the rendezvous and for every collective
    prefix: str  # store key prefix, fresh and random per group
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GroupInfo:
        expected = {"host": str, "port": int, "rank": int, "world_size": int, "timeout": (int, float),
                    "prefix": str, "bucket_bytes": int}
        if not isinstance(d, dict) or set(d) != set(expected):
            raise ValueError(f"weight group info: expected keys {sorted(expected)}, got "
                             f"{sorted(d) if isinstance(d, dict) else type(d).__name__}")
        for key, kind in expected.items():
            if not isinstance(d[key], kind) or isinstance(d[key], bool):
                raise ValueError(f"weight group info: {key} has type {type(d[key]).__name__}")
        info = cls(**d)
        if not (math.isfinite(info.timeout) and info.timeout > 0):
            raise ValueError(f"weight group info: timeout must be a finite number of seconds > 0, got {info.timeout}")
        if not 0 < info.port < 65536 or not 0 < info.rank < info.world_size or info.bucket_bytes <= 0:
            raise ValueError(f"weight group info out of range: port {info.port}, rank {info.rank}, world_size "
                             f"{info.world_size}, bucket_bytes {info.bucket_bytes}")
        return info


class WeightGroup:
    """One stateless gloo group; rank 0 sends. Not thread-safe: one thread uses it at a time."""

    def __init__(self, info: GroupInfo, rank: int, listen_socket: socket.socket | None = None):
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        self.rank = rank
        self.info = info
        self.pack_buffer: torch.Tensor | None = None  # rank 0's packing buffer (send_packed)
        self.receive_buffers: dict[int, torch.Tensor] = {}  # a member's buffer per bucket index (receive_packed)
        td = datetime.timedelta(seconds=info.timeout)
        try:
            if rank == 0:  # the store listens on the socket we bound (no port race, only the address we chose)
                self._store = TCPStore(info.host, info.port, world_size=info.world_size, is_master=True, timeout=td,
                                       wait_for_workers=False, master_listen_fd=listen_socket.detach())
            else:
                self._store = TCPStore(info.host, info.port, world_size=info.world_size, is_master=False,
                                       timeout=td, wait_for_workers=False)
            options = ProcessGroupGloo._Options()
            options._timeout = td
            # gloo's own listening sockets go on the interface that reaches the store, never on every interface
            options._devices = [ProcessGroupGloo.create_device(hostname=_local_address_towards(info.host, rank))]
            self._pg = ProcessGroupGloo(PrefixStore(info.prefix, self._store), rank, info.world_size, options)
        except Exception as exc:
            raise WeightBroadcastError(f"weight sync: the weight group at {info.host}:{info.port} (rank {rank} of "
                                       f"{info.world_size}) did not form within {info.timeout:.0f}s: {exc}") from exc

    def _options(self, cls):
        options = cls()
        options.timeout = datetime.timedelta(seconds=self.info.timeout)
        return options

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0 into every member's `tensor` (same size); returns when done."""
        from torch.distributed import BroadcastOptions

        options = self._options(BroadcastOptions)
        options.rootRank, options.rootTensor = 0, 0
        self._pg.broadcast([tensor], options).wait()

    def vote(self, accept: bool) -> bool:
        """Every member says whether it accepts the round; True only if all do (an all-reduce, MIN)."""
        from torch.distributed import AllreduceOptions, ReduceOp

        flag = torch.tensor([1 if accept else 0], dtype=torch.int32)
        options = self._options(AllreduceOptions)
        options.reduceOp = ReduceOp.MIN
        self._pg.allreduce([flag], options).wait()
        return bool(flag.item())

    def gather(self, tensor: torch.Tensor, out: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """Every member's `tensor` (same size everywhere) on rank 0, in rank order, into `out` if given (contiguous
        tensors, views of one buffer may do); None on the other members."""
        from torch.distributed import GatherOptions

        options = self._options(GatherOptions)
        options.rootRank = 0
        if self.rank != 0:
            out = None
        elif out is None:
            out = [torch.empty_like(tensor) for _ in range(self.info.world_size)]
        self._pg.gather([out] if out is not None else [], [tensor], options).wait()
        return out

    @property
    def store(self):
        """The group's store (rank 0 serves it): a member may pass small keys through it (`partitions.py`)."""
        return self._store

    def close(self) -> None:
        try:
            self._pg.shutdown()
        except Exception:  # already broken (a member left): nothing left to release
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


def listen(host: str, allow_remote: bool = False) -> socket.socket:
    """A listening socket for a group's store on `host` (port chosen by the kernel). A non-loopback `host` needs
    `allow_remote`: gloo authenticates nobody, so exposing it must be asked for."""
    if not is_loopback(host) and not allow_remote:
        raise ValueError(f"weight_sync_host: {host!r} is not a loopback address; set allow_remote (--allow_remote) "
                         "to let generators on other machines join the weight group (gloo authenticates nobody: "
                         "use a private network)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def new_prefix() -> str:
    return f"async_rlhf/{secrets.token_hex(16)}/"


# ---------------------------------------------------------------- the per-version protocol


def check_metadata(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], what: str) -> None:
    """Raise ValueError unless the three lists are parallel, every dtype is in `DTYPES` and every shape is a list of
    non-negative ints (what a receiver needs to size its buffers safely)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"{what}: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    for name, dtype, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str):
            raise ValueError(f"{what}: tensor name {name!r} is not a string")
        if dtype not in DTYPES:
            raise ValueError(f"{what}: {name} has dtype {dtype!r}, not one of {list(DTYPES)}")
        if not isinstance(shape, (list, tuple)) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ValueError(f"{what}: {name} has shape {shape!r}")


def num_bytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def bucket_plan(dtypes: Sequence[str], shapes: Sequence[Sequence[int]], bucket_bytes: int) -> list[range]:
    """Index ranges of the buckets, in order: a tensor of at least `SOLO_BYTES` (or `bucket_bytes`) travels alone,
    straight from its memory; runs of smaller ones are packed, a bucket closed once it holds >= `bucket_bytes`."""
    plan, start, size = [], 0, 0
    solo = min(SOLO_BYTES, bucket_bytes)
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        n = num_bytes(dtype, shape)
        if n >= solo:
            if start < i:
                plan.append(range(start, i))
            plan.append(range(i, i + 1))
            start, size = i + 1, 0
            continue
        size += n
        if size >= bucket_bytes:
            plan.append(range(start, i + 1))
            start, size = i + 1, 0
    if start < len(dtypes):
        plan.append(range(start, len(dtypes)))
    return plan


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def send_packed(group: WeightGroup, tensors: Iterable[torch.Tensor], bucket_bytes: int) -> None:
    """Rank 0: broadcast `tensors` (CPU) bucket by bucket, in order, as `bucket_plan` cuts them. `tensors` may be a
    lazy stream (`partitions.PartitionedState`): the plan depends only on each tensor's size in turn, so a bucket is
    sent as soon as it is complete and nothing past it has to exist yet. Buckets of several tensors are packed into
    one buffer the group keeps (each broadcast returns only when sent, so it is free again): memory touched once, not
    a fresh allocation per bucket, whose page faults cost more than the copy itself on the machines measured."""
    solo = min(SOLO_BYTES, bucket_bytes)
    pending: list[torch.Tensor] = []
    size = 0  # bytes in `pending`

    def flush() -> None:
        nonlocal size
        if len(pending) == 1:
            group.broadcast(pending[0])
        elif pending:
            if group.pack_buffer is None or group.pack_buffer.numel() < size:
                group.pack_buffer = torch.empty(size, dtype=torch.uint8)
            packed = group.pack_buffer[:size]
            torch.cat(pending, out=packed)
            group.broadcast(packed)
        pending.clear()
        size = 0

    for tensor in tensors:
        part = _as_bytes(tensor)
        if part.numel() >= solo:
            flush()
            group.broadcast(part)
            continue
        pending.append(part)
        size += part.numel()
        if size >= bucket_bytes:
            flush()
    flush()


def receive_packed(group: WeightGroup, names: Sequence[str], dtypes: Sequence[str],
                   shapes: Sequence[Sequence[int]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A member: yield one list of `(name, tensor)` per bucket as it arrives (views of one buffer per bucket). The
    caller must consume every bucket (rank 0 sends them all), or close the group.

    The buffers are the group's, kept from one version to the next (reallocated only when the plan changes): a
    member therefore holds one copy of the state, as the shm path's mapped file does. Not fresh buffers per version,
    because touching fresh memory was the whole cost here (0.1-0.5 GB/s of page faults on the 2-core VM measured,
    against 1-3 GB/s for gloo itself); not one buffer reused within a version, because vLLM's layerwise reload keeps
    the tensors it is given until their layer is complete (attention layers until the reload finishes). Reusing them
    at the next version is safe: the reload has copied everything into the model's own tensors by then."""
    plan = bucket_plan(dtypes, shapes, bucket_bytes)
    cache = group.receive_buffers
    for b, bucket in enumerate(plan):
        sizes = [num_bytes(dtypes[i], shapes[i]) for i in bucket]
        buffer = cache.get(b)
        if buffer is None or buffer.numel() != sum(sizes):
            buffer = cache[b] = torch.empty(sum(sizes), dtype=torch.uint8)
        group.broadcast(buffer)
        yield [(names[i], _typed(part, DTYPES[dtypes[i]], shapes[i])) for i, part in zip(bucket, buffer.split(sizes))]


def _typed(part: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """`part` (bytes) as a `dtype` tensor of `shape`; copied only when its offset is not aligned for `dtype` (a
    one-byte tensor earlier in the bucket can leave it so)."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype).view(list(shape))
