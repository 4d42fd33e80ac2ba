"""Learner rank 0's side of the "network" weight transport, and the choice of a transport per generator.

Which transport a generator gets (`config.checks.choose_transport`, config `weight_transport`):
    auto      CUDA IPC if it runs on learner rank 0's own GPU; shm if it can read learner rank 0's `shm_dir` (same
              host: a local process; a server that reads the learner's probe file); the network otherwise
    shm / ipc / network   forced (refused where it cannot work, naming the generator)
A server on another host is recognised without a flag: the pool writes a probe file with a random nonce into its
`shm_dir` and asks the server (`POST /async_rlhf/weight_probe`, behind the bearer token) whether it reads that nonce
there (`generation/serve.py`).

`StateTransport` is the run's `WeightTransport` when some generators take shm and some the network: `publish`
writes the shm file only if a generator uses shm, and keeps the gathered CPU state of the version only if one
uses the network (released, like the files, once every generator has loaded a newer version). So the learner is
blocked for the gather (and the shm write where needed), never for the network send: the pool sends on a thread per
generator, at that generator's turn.

The network send (`trainer_engine`): vLLM's trainer-side engine from its factory, the documented way
(`WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`, then `send_weights()` per version):
- CPU: our `async_rlhf_gloo` (`vllm_gloo_engine.py`);
- GPU: vLLM's own `nccl` (`NCCLTrainerInitInfo(master_address, master_port, world_size, packed=True)`). Our code
  adds nothing to it: no NCCL code of ours. This path is unrun here (no GPU with vLLM in CI): it needs the generator
  started with `--weight-transfer-config '{"backend": "nccl"}'` and is selected by `network_backend="nccl"`.
Both replay a `StateSource` holding the version being sent, and label the version through `VersionedClient`
(vLLM's engines call `finish_weight_update()` without one). One group per generator (see `broadcast.py` for why);
its rendezvous: the learner opens a listening socket (loopback unless `allow_remote`), sends the group's address and
random key prefix through the generator's authenticated channel (the server's token-protected
`/init_weight_transfer_engine` route, or a local generator's inbox), and forms the group as rank 0 while the
generator joins. A generator that is restarted or added gets a new group when it starts, before its first update,
so it joins at the next version sent after it is up.
"""

from __future__ import annotations

import math
import os
import secrets
import threading

import torch

from async_rlhf.config.checks import NETWORK_BACKENDS
from async_rlhf.types import WeightUpdate
from async_rlhf.weight_sync.partitions import PartitionStore, state_meta
from async_rlhf.weight_sync.shm import ShmWeightTransport

PROBE_PREFIX = "async_rlhf-probe-"
PROBE_ROUTE = "/async_rlhf/weight_probe"  # served by generation/serve.py's middleware, asked by the HTTP pool


def write_probe(shm_dir: str) -> tuple[str, str]:
    """A probe file in `shm_dir` holding a random nonce: (path, nonce). The caller removes it."""
    nonce = secrets.token_hex(16)
    path = os.path.join(shm_dir, f"{PROBE_PREFIX}{secrets.token_hex(8)}")
    with open(path, "w") as f:
        f.write(nonce)
    return path, nonce


def reads_probe(path: str, nonce: str) -> bool:
    """Generator side: whether this process reads `nonce` in `path` (only probe files are opened)."""
    if not os.path.basename(path).startswith(PROBE_PREFIX):
        return False
    try:
        with open(path) as f:
            return f.read(64) == nonce
    except OSError:
        return False


def update_metadata(state) -> dict:
    """A `WeightUpdate`'s names, dtypes, shapes and size for a state dict or a `partitions.PartitionedState`."""
    meta = state_meta(state)
    return {"names": [n for n, _, _ in meta], "dtypes": [str(d).removeprefix("torch.") for _, d, _ in meta],
            "shapes": [s for _, _, s in meta], "num_bytes": sum(math.prod(s) * d.itemsize for _, d, s in meta)}


class StateTransport:
    """`transport.WeightTransport` for generators that take shm, the network, or both (`use(...)` says which are in
    use; a local pool may add generators of either kind later). `publish` returns a "network" update that also names
    the shm file when one was written; the pool sends each generator the form it takes (`for_transport`)."""

    name = "network"

    def __init__(self, shm_dir: str):
        self.shm_dir = shm_dir
        self._shm: ShmWeightTransport | None = None
        self.network = False
        self._states: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.send_seconds = 0.0  # summed over generators and versions, on the pool's sender threads
        self.sends = 0
        # ZeRO-3 with every generator on the network: the states are rank 0's partitions (`partitions.py`), set by
        # the pipeline at its first sync
        self.partitions: PartitionStore | None = None
        self.held_bytes_peak = 0  # full states held for the network at once (without partitions)

    def use(self, transport: str) -> None:
        if transport == "shm" and self._shm is None:
            self._shm = ShmWeightTransport(self.shm_dir)
        elif transport == "network":
            self.network = True
        elif transport not in ("shm", "network"):
            raise ValueError(f"StateTransport carries shm and network updates, not {transport!r}")

    device = "cpu"

    def network_only(self) -> bool:
        """Whether every generator in use takes the network (none needs a file of the whole state)."""
        return self.network and self._shm is None

    def use_partitions(self, store: PartitionStore) -> None:
        """From the next publish on, versions are rank 0's partitions (ZeRO-3 learners; `partitions.py`)."""
        if not self.network_only():
            raise ValueError("weights: partitions need every generator on the network transport")
        self.partitions = store

    def publish(self, state: dict[str, torch.Tensor], version: int) -> WeightUpdate:
        path = self._shm.publish(state, version).path if self._shm is not None else ""
        if self.network:
            with self._lock:
                self._states[version] = state
                if self.partitions is None:
                    held = sum(update_metadata(s)["num_bytes"] for s in self._states.values())
                    self.held_bytes_peak = max(self.held_bytes_peak, held)
        return WeightUpdate(version=version, transport="network", path=path, **update_metadata(state))

    def state(self, version: int) -> dict[str, torch.Tensor]:
        with self._lock:
            if version not in self._states:
                raise KeyError(f"weights v{version} are not held for the network (released, or never published)")
            return self._states[version]

    def newest(self) -> int | None:
        with self._lock:
            return max(self._states, default=None)

    def release(self, version: int) -> None:
        if self._shm is not None:
            self._shm.release(version)
        with self._lock:
            for v in [v for v in self._states if v < version]:
                del self._states[v]
        if self.partitions is not None:
            self.partitions.release(version)

    def record_send(self, seconds: float) -> None:
        with self._lock:
            self.send_seconds += seconds
            self.sends += 1

    def stats(self) -> dict[str, float]:
        """`sync/network_send_seconds`: mean seconds of one version's send to one generator; `sync/held_bytes_peak`:
        the most bytes rank 0 held at once for the network (full states, or its partitions plus a send's bucket)."""
        out = self.partitions.stats() if self.partitions is not None else {}
        with self._lock:
            if self.network and self.partitions is None:
                out["sync/held_bytes_peak"] = float(self.held_bytes_peak)
            if self.sends:
                out["sync/network_send_seconds"] = self.send_seconds / self.sends
        return out

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
        with self._lock:
            self._states.clear()


def for_transport(update: WeightUpdate, transport: str) -> WeightUpdate:
    """`update` (from `StateTransport.publish`) as generator of `transport` takes it."""
    from dataclasses import replace

    if transport == "shm" and not update.path:
        raise ValueError(f"weights v{update.version}: no shm file was written (no generator was marked for shm)")
    return replace(update, transport=transport)


class VersionedClient:
    """A `VLLMWeightSyncClient` that labels `finish_weight_update` with `version` (set before each round): vLLM's
    trainer engines finish without a version, and ours must be the engine's weight version."""

    def __init__(self, client) -> None:
        self.client = client
        self.version: int | None = None

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version if weight_version is not None else str(self.version))


class NetworkSender:
    """One generator's network channel on learner rank 0: vLLM's trainer-side engine over a `StateSource`.
    `open` rendezvouses (blocking, at most `timeout`); `send(version, state)` one round (blocking)."""

    def __init__(self, client, workers: int, timeout: float, host: str = "127.0.0.1", allow_remote: bool = False,
                 backend: str = "gloo", bucket_bytes: int | None = None):
        if backend not in NETWORK_BACKENDS:
            raise ValueError(f"network_backend: {backend!r} is not one of {NETWORK_BACKENDS}")
        self.client = VersionedClient(client)
        self.workers = workers
        self.timeout = timeout
        self.host = host
        self.allow_remote = allow_remote
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.engine = None
        from async_rlhf.weight_sync.vllm_gloo_engine import StateSource

        self.source = StateSource()

    def open(self) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        if self.backend == "gloo":
            from async_rlhf.weight_sync import broadcast
            from async_rlhf.weight_sync.vllm_gloo_engine import GlooTrainerInitInfo

            info = GlooTrainerInitInfo(rank=0, world_size=1 + self.workers, host=self.host, timeout=self.timeout,
                                       allow_remote=self.allow_remote,
                                       bucket_bytes=self.bucket_bytes or broadcast.DEFAULT_BUCKET_BYTES)
        else:  # GPU: vLLM's own engine, documented calls only (unrun here)
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            from async_rlhf.weight_sync import broadcast

            with broadcast.listen(self.host, self.allow_remote) as sock:  # a free port on the chosen address
                port = sock.getsockname()[1]
            info = NCCLTrainerInitInfo(rank=0, master_address=self.host, master_port=port,
                                       world_size=1 + self.workers, packed=True)
            self.source.device = torch.device("cuda", torch.cuda.current_device())
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def send(self, version: int, state: dict[str, torch.Tensor]) -> None:
        self.source.state = state
        self.client.version = version
        try:
            self.engine.send_weights()
        finally:
            self.source.state = {}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
