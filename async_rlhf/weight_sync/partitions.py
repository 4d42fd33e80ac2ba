"""ZeRO-3 learners on the network transport: every learner rank keeps its own partitions of a version, and learner
rank 0 assembles full tensors bucket by bucket only while it sends them.

Used when the policy is ZeRO-3 partitioned and `weight_transport="network"` (every generator takes the network, so
nobody needs a file of the whole state). At a sync each rank copies its partition of every parameter to CPU
(`PartitionStore.take`: local, no collective, 1/W of the state), which is all the learner is blocked for. When
a generator's turn comes, its sender on rank 0 iterates `PartitionedState.items()`: for each bucket of the send
(`broadcast.bucket_plan`) rank 0 gathers the other ranks' partitions of that bucket over a gloo group of the
learners' own (`broadcast.WeightGroup`, on MASTER_ADDR like the learners' own rendezvous), joins them into full
tensors and hands them on, to be broadcast to the generator before the next bucket is gathered. So rank 0 never
holds the whole state on CPU: it holds its partitions of each version not yet released, and during a send one
bucket of full tensors plus the W partitions they came from (`stats()`: `sync/held_bytes_peak`).

Layout, as DeepSpeed's `Init._partition_param` writes it: partition rank r holds elements [r*p, (r+1)*p) of the
flattened parameter, p = ceil(numel / W), the last one zero-padded; `ds_tensor` is that partition, `ds_numel` and
`ds_shape` the full parameter's. Buffers are never partitioned: rank 0 copies its own.

The other ranks serve rank 0 from a thread: rank 0 posts commands to the group's store under keys `cmd/0`,
`cmd/1`, ... (JSON: `{"op": "send", "version": v}`, `{"op": "release", "below": v}`, `{"op": "stop"}`), every other
rank reads them in order. A send waits (at most the timeout) for this rank's own copy of the version, which its
training loop takes at the same step as rank 0. Sends run one at a time (rank 0's lock), so two generators' senders
never interleave their gathers. Every collective, and every wait for a version, is bounded by `timeout`
(`weight_sync_timeout`); a failure ends the send with `WeightBroadcastError` and the group is then unusable: the
store is marked broken and later sends fail at once (the run's failure path takes over).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

import torch

from async_rlhf.weight_sync import broadcast
from async_rlhf.weight_sync.broadcast import GroupInfo, WeightBroadcastError, WeightGroup

logger = logging.getLogger(__name__)


def state_meta(state) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of each tensor of a state dict or a `PartitionedState`, in order, without assembling."""
    if isinstance(state, PartitionedState):
        return list(state.meta)
    return [(n, t.dtype, list(t.shape)) for n, t in state.items()]


class PartitionedState:
    """Rank 0's handle on version `version` held as partitions: `meta` without any collective, `items()` assembles
    (name, full CPU tensor) pairs in the state dict's order, bucket by bucket (see the module docstring)."""

    def __init__(self, store: PartitionStore, version: int):
        self.store = store
        self.version = version
        self.meta = store.meta

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.store.stream(self.version)

    def __len__(self) -> int:
        return len(self.meta)


class PartitionStore:
    """One per learner rank (`open` is a collective over the learners' process group; see the module docstring)."""

    def __init__(self, model: torch.nn.Module, group: WeightGroup, rank: int, world_size: int, timeout: float,
                 bucket_bytes: int):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        # the state dict's names, each a partitioned parameter (index into `params`) or a buffer; ordered as
        # `gather.gather_full_state` orders them, so both paths send the same names
        named = OrderedDict(model.named_parameters(remove_duplicate=False))
        self.params: list[torch.nn.Parameter] = []
        index: dict[int, int] = {}
        self.entries: list[tuple[str, int | None]] = []  # (name, parameter index or None for a buffer)
        meta = []
        buffers = dict(model.named_buffers())
        for name in model.state_dict().keys():
            if name in named:
                p = named[name]
                if id(p) not in index:
                    _check_layout(name, p, world_size)
                    index[id(p)] = len(self.params)
                    self.params.append(p)
                self.entries.append((name, index[id(p)]))
                meta.append((name, p.dtype, list(p.ds_shape)))
            elif name in buffers:
                self.entries.append((name, None))
                meta.append((name, buffers[name].dtype, list(buffers[name].shape)))
        self.meta = meta
        self.plan = broadcast.bucket_plan([str(d).removeprefix("torch.") for _, d, _ in meta],
                                          [s for _, _, s in meta], bucket_bytes)
        self._model = model
        self._versions: dict[int, tuple[list[torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._taken = threading.Condition()
        self._send_lock = threading.Lock()  # one send at a time (rank 0)
        self._post_lock = threading.Lock()
        self._seq = 0
        self.broken: Exception | None = None
        self.held_bytes_peak = 0
        self._closed = False
        self._thread = None
        if rank != 0:
            self._thread = threading.Thread(target=self._serve, daemon=True, name="async_rlhf-partition-server")
            self._thread.start()

    @classmethod
    def open(cls, model: torch.nn.Module, timeout: float,
             bucket_bytes: int = broadcast.DEFAULT_BUCKET_BYTES) -> PartitionStore:
        """Every learner rank, at the same point: rank 0 binds the group's store on MASTER_ADDR and the others learn
        where through the learners' own process group (one object broadcast). Raises ValueError, naming the
        parameter, before any collective when a parameter is not a plain ZeRO-3 partition (`_check_layout`)."""
        import torch.distributed as dist

        from async_rlhf.weight_sync.gather import _unwrap

        rank, world = dist.get_rank(), dist.get_world_size()
        model = _unwrap(model)
        for name, p in model.named_parameters():  # before any collective: every rank refuses alike
            _check_layout(name, p, world)
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        sock, payload = None, [None]
        if rank == 0:
            # the learners' own store already listens on MASTER_ADDR: this group is no wider
            sock = broadcast.listen(host, allow_remote=True)
            payload = [GroupInfo(host=host, port=sock.getsockname()[1], rank=1, world_size=world, timeout=timeout,
                                 prefix=broadcast.new_prefix(), bucket_bytes=bucket_bytes).to_dict()]
        dist.broadcast_object_list(payload, src=0)
        info = GroupInfo.from_dict(payload[0])
        group = WeightGroup(info, rank=rank, listen_socket=sock)
        return cls(model, group, rank, world, timeout, bucket_bytes)

    # ---- every rank ------------------------------------------------------------------------------------
    def take(self, version: int) -> PartitionedState | None:
        """Copy this rank's partitions of the model's current weights as `version` (rank 0: and the buffers).
        Returns rank 0's handle, None elsewhere."""
        parts = [p.ds_tensor.detach().to("cpu", copy=True) for p in self.params]
        buffers = {}
        if self.rank == 0:
            live = dict(self._model.named_buffers())
            buffers = {n: live[n].detach().to("cpu", copy=True) for n, i in self.entries if i is None}
        with self._taken:
            self._versions[version] = (parts, buffers)
            self._taken.notify_all()
        self._note_held(0)
        return PartitionedState(self, version) if self.rank == 0 else None

    def _drop_below(self, version: int) -> None:
        with self._taken:
            for v in [v for v in self._versions if v < version]:
                del self._versions[v]

    def _note_held(self, extra: int) -> None:
        with self._taken:
            held = sum(t.numel() * t.element_size() for parts, buffers in self._versions.values()
                       for t in (*parts, *buffers.values()))
        self.held_bytes_peak = max(self.held_bytes_peak, held + extra)

    def _version(self, version: int):
        with self._taken:
            if not self._taken.wait_for(lambda: version in self._versions or self._closed, self.timeout):
                raise WeightBroadcastError(f"weight sync: learner rank {self.rank} has no copy of v{version} "
                                           f"after {self.timeout:.0f}s (its training loop did not reach that step)")
            if version not in self._versions:
                raise WeightBroadcastError(f"weight sync: v{version} is not held (closed or released)")
            return self._versions[version]

    def _bucket_bytes_of(self, parts: list[torch.Tensor], bucket: range) -> torch.Tensor | None:
        """This rank's partitions of the parameters in `bucket`, as one byte buffer (None: only buffers)."""
        mine = [parts[i].contiguous().view(-1).view(torch.uint8) for _, i in (self.entries[k] for k in bucket)
                if i is not None]
        return torch.cat(mine) if mine else None

    # ---- rank 0 ----------------------------------------------------------------------------------------
    def _post(self, command: dict) -> None:
        with self._post_lock:
            self.group.store.set(f"cmd/{self._seq}", json.dumps(command))
            self._seq += 1

    def stream(self, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0: version `version`'s (name, full tensor) pairs, gathered bucket by bucket. Abandoned part-way (the
        generator failed), it still gathers the rest, so the other ranks are never left waiting in a collective."""
        if self.rank != 0:
            raise RuntimeError("PartitionStore.stream runs on learner rank 0 only")
        with self._send_lock:
            if self.broken is not None:
                raise WeightBroadcastError(f"weight sync: the learners' partition group failed earlier: "
                                           f"{self.broken}")
            parts, buffers = self._version(version)
            self._post({"op": "send", "version": version})
            done = 0
            try:
                for bucket in self.plan:
                    out = self._assemble(parts, buffers, bucket)
                    done += 1
                    yield from out
                    del out
            finally:
                try:
                    for bucket in self.plan[done:] if self.broken is None else ():  # the others gather every bucket: finish the round with them
                        self._gather(parts, bucket)
                except Exception as exc:
                    self.broken = exc
                    raise

    def _gather(self, parts, bucket: range, out: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        mine = self._bucket_bytes_of(parts, bucket)
        if mine is None:
            return None
        try:
            return self.group.gather(mine, out)
        except Exception as exc:
            self.broken = exc
            raise WeightBroadcastError(f"weight sync: gathering the learners' partitions failed or timed out "
                                       f"({self.timeout:.0f}s): {exc}") from exc

    def _assemble(self, parts, buffers, bucket: range) -> list[tuple[str, torch.Tensor]]:
        """Bucket `bucket`'s full tensors. A bucket of one parameter (the large ones: `broadcast.SOLO_BYTES`) is
        gathered straight into its full tensor (each rank's partition lands in its slice); a packed bucket is
        gathered rank by rank and then copied into place."""
        entries = [self.entries[k] for k in bucket]
        if len(entries) == 1 and entries[0][1] is not None and parts[entries[0][1]].numel():
            (name, i), (_, dtype, shape) = entries[0], self.meta[bucket[0]]
            part = parts[i]
            flat = torch.empty(part.numel() * self.world_size, dtype=part.dtype)
            self._gather(parts, bucket, [c.view(torch.uint8) for c in flat.split(part.numel())])
            self._note_held(flat.numel() * flat.element_size())
            return [(name, flat[:math.prod(shape)].view(shape))]
        gathered = self._gather(parts, bucket)
        out, offset, extra = [], 0, sum(g.numel() for g in gathered) if gathered else 0
        for k in bucket:
            name, i = self.entries[k]
            if i is None:
                out.append((name, buffers[name]))
                continue
            part = parts[i]
            size = part.numel() * part.element_size()
            chunks = [g[offset:offset + size] for g in gathered]
            offset += size
            _, dtype, shape = self.meta[k]
            full = torch.cat(chunks).view(dtype)[:math.prod(shape)].view(shape)
            extra += full.numel() * full.element_size()
            out.append((name, full))
        self._note_held(extra)
        return out

    def release(self, below: int) -> None:
        """Rank 0: every rank drops its copies of versions older than `below`."""
        self._drop_below(below)
        if self.broken is None:
            try:
                self._post({"op": "release", "below": below})
            except Exception as exc:  # the group is gone: the run is failing already
                self.broken = exc

    # ---- the other ranks ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        seq = 0
        while not self._closed:
            key = f"cmd/{seq}"
            try:  # polled: a blocking wait that times out is logged by c10d every time
                posted = self.group.store.check([key])
            except Exception:  # rank 0's store is gone: training fails on its own collectives, then closes this
                time.sleep(1.0)
                continue
            if not posted:
                time.sleep(0.02)
                continue
            try:
                command = json.loads(self.group.store.get(key))
                seq += 1
                if command["op"] == "stop":
                    return
                if command["op"] == "release":
                    self._drop_below(int(command["below"]))
                elif command["op"] == "send":
                    parts, _ = self._version(int(command["version"]))
                    for bucket in self.plan:
                        self._gather(parts, bucket)
            except Exception as exc:
                self.broken = exc
                logger.error("learner rank %d: serving weight partitions to rank 0 failed: %s: %s", self.rank,
                             type(exc).__name__, exc)
                return

    def stats(self) -> dict[str, float]:
        """`sync/partitioned` 1: this path is in use; `sync/held_bytes_peak`: rank 0's partitions of every version
        held at once plus, during a send, one bucket's gathered partitions and full tensors."""
        return {"sync/partitioned": 1.0, "sync/held_bytes_peak": float(self.held_bytes_peak)}

    def close(self, wait: float = 0.0) -> None:
        """Rank 0 posts "stop" (call it after the last send); another rank first serves on for at most `wait`
        seconds, until rank 0's "stop" (rank 0 may still be sending the last version when training ends here)."""
        if self.rank == 0 and not self._closed and self.broken is None:
            try:
                self._post({"op": "stop"})
            except Exception:
                pass
        if self._thread is not None and wait > 0:
            self._thread.join(wait)
        self._closed = True
        with self._taken:
            self._versions.clear()
            self._taken.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
        self.group.close()


def _check_layout(name: str, p: torch.nn.Parameter, world_size: int) -> None:
    """Refuse what this store cannot reassemble, naming the parameter: only plain ZeRO-3 partitions qualify."""
    ds = getattr(p, "ds_tensor", None)
    if ds is None or not hasattr(p, "ds_numel") or not hasattr(p, "ds_shape"):
        raise ValueError(f"{name}: not a ZeRO-3 partitioned parameter (no ds_tensor / ds_numel / ds_shape)")
    if "nvme" in str(getattr(ds, "final_location", "")).lower():
        raise ValueError(f"{name}: its partition is offloaded to NVMe (swapped out between uses); the partitions "
                         "path reads partitions in place, so it supports parameters on the device or in CPU memory")
    if ds.numel() != math.ceil(p.ds_numel / world_size):
        raise ValueError(f"{name}: partition of {ds.numel()} elements, expected ceil({p.ds_numel} / {world_size}) "
                         "(a partition group other than all learners, e.g. ZeRO++'s hpZ, is not supported)")
