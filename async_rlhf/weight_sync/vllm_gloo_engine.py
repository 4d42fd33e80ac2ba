"""`async_rlhf_gloo`: the CPU twin of vLLM's `nccl` weight-transfer engine, registered in vLLM's factories.

Shaped like vLLM 0.32's `vllm/distributed/weight_transfer/nccl_engine.py`, and driven by the same calls (`init_weight_transfer_engine`,
`start_weight_update`, `update_weights`, `finish_weight_update`: methods of `vllm.LLM`, HTTP routes of `vllm serve`):
- `init_weight_transfer_engine({"group": GroupInfo})`: the worker joins a group of its own with learner rank 0
  (`broadcast.WeightGroup`, gloo), as rank `group.rank` + its rank in the engine. The learner's trainer-side engine
  makes that call on a thread while it opens the group as rank 0 itself: both rendezvous together.
- `update_weights({"names", "dtype_names", "shapes"})` (the fields of vLLM's `NCCLWeightTransferUpdateInfo`): the
  worker checks them against its model, every member votes, and the raw bytes follow in packed buckets
  (`broadcast.py`), each loaded with `model.load_weights` as it arrives, inside vLLM's layerwise reload (the
  engine's start and finish), as the nccl engine does. The trainer runs the route on a thread while it broadcasts.
So CI drives the same trainer-side code, pool code and vLLM routes that a GPU deployment drives with vLLM's `nccl`
backend (`NCCLTrainerInitInfo`; see `network.py`), with gloo in place of PyNccl.

The worker side also takes the `async_rlhf_shm` updates (`{"path", "version", "names"}`: a file in the learner's
`shm_dir`), so a generator or server started with this backend can be fed either way, and the learner picks per
generator (`network.choose_transport`). `init_weight_transfer_engine({})` (what the shm trainer engine sends)
joins no group.

Guarantees (worker side):
- names, dtypes or shapes that differ from the model's (`state_dict_meta` of the served checkpoint: names and
  shapes exactly; dtypes from `broadcast.DTYPES`) are refused before any weight byte moves: the worker votes no,
  finalizes the reload with nothing loaded (every layer's previous tensors back) and raises naming the difference;
  the trainer side raises `WeightBroadcastError` with the generator's reason. Old weights stay loaded and served.
- every collective is bounded by the group's `timeout` (the learner's `weight_sync_timeout`); a member that dies
  mid-broadcast makes the others' collective fail within it. A failure after bytes started loading leaves the
  model part-updated: the caller must treat the generator as broken (our generator process exits; a server is
  reported failed, naming it).
- a second `init_weight_transfer_engine` closes the old group first: a restarted learner, or a generator that
  joins again, gets a fresh group (new port, new random prefix).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from async_rlhf.weight_sync import broadcast
from async_rlhf.weight_sync.broadcast import GroupInfo, WeightBroadcastError, WeightGroup
from async_rlhf.weight_sync.partitions import state_meta
from async_rlhf.weight_sync.vllm_shm_engine import ShmWeightTransferEngine, register_backend

BACKEND = "async_rlhf_gloo"


def state_dict_meta(model_path: str) -> dict[str, tuple[str, list[int]]]:
    """{name: (dtype name, shape)} of the transformers model's `state_dict()`, which is what the learner sends.
    Built on the meta device from the config alone, so it costs no memory and works for hub ids too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
    return {n: (str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in model.state_dict().items()}


def check_against_model(expected: dict[str, tuple[str, list[int]]], names: list[str],
                        shapes: list[list[int]]) -> None:
    """Raise ValueError unless `names` are exactly the model's and every shape is the model's."""
    missing, unexpected = expected.keys() - set(names), set(names) - expected.keys()
    if missing or unexpected:
        raise ValueError(f"weight update names differ from the model's: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    wrong = [(n, list(s), expected[n][1]) for n, s in zip(names, shapes) if list(s) != expected[n][1]]
    if wrong:
        raise ValueError(f"weight update shapes differ from the model's (name, sent, expected): {wrong[:5]}")


# ---------------------------------------------------------------- worker side (inside vLLM's worker process)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    group: dict | None = None  # broadcast.GroupInfo as a dict; None: shm updates only


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]  # [K] HF state_dict names, in the order the bytes come
    dtype_names: list[str]  # [K] keys of broadcast.DTYPES
    shapes: list[list[int]]  # [K]


class GlooWeightTransferEngine(ShmWeightTransferEngine):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False
    _group: WeightGroup | None = None
    _expected: dict | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        if init_info.group is None:
            return
        info = GroupInfo.from_dict(init_info.group)
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        if info.rank + worker >= info.world_size:
            raise ValueError(f"weight group: worker {worker} would be rank {info.rank + worker} of a group of "
                             f"{info.world_size} (the learner counted fewer workers than this engine has)")
        if self._expected is None:
            self._expected = state_dict_meta(self.model_config.model)
        self._group = WeightGroup(info, rank=info.rank + worker)

    def update_weights(self, update_info: dict) -> None:
        if "path" in update_info:  # an `async_rlhf_shm` update: a file in the learner's shm_dir
            return super().update_weights(update_info)
        if self._group is None:
            self.finish_weight_update()
            raise RuntimeError(f"backend {BACKEND!r}: a network weight update before init_weight_transfer_engine "
                               "joined a group")
        reason: Exception | None = None
        try:
            info = self.parse_update_info(update_info)
            broadcast.check_metadata(info.names, info.dtype_names, info.shapes, "weight update")
            check_against_model(self._expected, info.names, info.shapes)
        except Exception as exc:  # refused: say so to every member before any byte moves
            reason = exc
        try:
            accepted = self._group.vote(reason is None)
        except Exception:
            self.finish_weight_update()
            raise
        if not accepted:
            self.finish_weight_update()  # nothing loaded: every layer's previous tensors come back
            raise reason or WeightBroadcastError("weight update refused by learner rank 0 (see its log)")
        self.receive_weights(info)

    def receive_weights(self, update_info) -> None:
        if not isinstance(update_info, GlooUpdateInfo):  # a shm file
            return super().receive_weights(update_info)
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        buckets = broadcast.receive_packed(self._group, update_info.names, update_info.dtype_names,
                                           update_info.shapes, self._group.info.bucket_bytes)
        with disable_mtp_completeness_check():
            for bucket in buckets:
                self.model.load_weights(bucket)

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


# ---------------------------------------------------------------- trainer side (learner rank 0)


class StateSource(WeightSource):
    """vLLM's `WeightSource` over a full state dict of CPU tensors that nobody mutates (the gathered copy), or a
    `partitions.PartitionedState` (ZeRO-3: assembled as it is iterated); `state` may be replaced between rounds (one
    version per round). With `device` (vLLM's nccl engine on a GPU), each
    tensor is copied there as it is iterated, so one tensor at a time, not the state, sits on the device."""

    def __init__(self, state: dict[str, torch.Tensor] | None = None, device: torch.device | None = None) -> None:
        self.state = state or {}
        self.device = device

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, dtype, tuple(shape)) for n, dtype, shape in state_meta(self.state)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.state.items():
            yield name, tensor if self.device is None else tensor.to(self.device, non_blocking=True)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    world_size: int = 2  # learner rank 0 + the generator's workers
    host: str = "127.0.0.1"  # where the group's store listens; not loopback needs allow_remote
    timeout: float = 300.0  # seconds, for the rendezvous and every collective (weight_sync_timeout)
    allow_remote: bool = False
    bucket_bytes: int = broadcast.DEFAULT_BUCKET_BYTES


def run_bounded(fn, timeout: float, what: str):
    """`fn()` on a daemon thread, waited for at most `timeout` (a hung peer must not hang the caller, nor its exit).
    Returns a `join` callable that returns fn's result or raises its error (or WeightBroadcastError on timeout)."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # handed to whoever joins
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"async_rlhf-{what}")
    thread.start()

    def join(wait: float = timeout):
        thread.join(wait)
        if thread.is_alive():
            raise WeightBroadcastError(f"weight sync: {what} did not return within {wait:.0f}s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    join.done = lambda: not thread.is_alive()  # type: ignore[attr-defined]
    return join


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Learner rank 0's end: holds the group, replays the `WeightSource` at each `send_weights()` (like vLLM's nccl
    trainer engine; the version label is the client's business: `network.VersionedClient`)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 timeout: float = 300.0, bucket_bytes: int = broadcast.DEFAULT_BUCKET_BYTES) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.timeout = timeout
        self.bucket_bytes = bucket_bytes
        self.group: WeightGroup | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError(f"backend {BACKEND!r} needs a WeightSource (it replays it at every send_weights)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, timeout=init_info.timeout,
                     bucket_bytes=init_info.bucket_bytes)
        if not engine.is_sender:
            return engine
        sock = broadcast.listen(init_info.host, init_info.allow_remote)
        info = GroupInfo(host=init_info.host, port=sock.getsockname()[1], rank=1, world_size=init_info.world_size,
                         timeout=init_info.timeout, prefix=broadcast.new_prefix(), bucket_bytes=init_info.bucket_bytes)
        # the workers block inside init_weight_transfer_engine until the group forms: call it on a thread while
        # another forms the group as rank 0; whichever fails first is the error (a refused token at once, not after
        # the timeout: the abandoned rendezvous thread is a daemon that gives up at its own timeout)
        joined = run_bounded(lambda: client.init_weight_transfer_engine({"group": info.to_dict()}),
                             init_info.timeout + 30.0, "init_weight_transfer_engine")
        formed = run_bounded(lambda: WeightGroup(info, rank=0, listen_socket=sock), init_info.timeout + 30.0,
                             "the weight group's rendezvous")
        while not formed.done():
            if joined.done():
                try:
                    joined(0)
                except BaseException:
                    sock.close()
                    raise
                break  # the workers joined: the group is forming now
            time.sleep(0.01)
        engine.group = formed()
        joined()
        return engine

    def send_weights(self) -> None:
        """One round: start, update (the workers receive on the route's thread) with the broadcast, finish."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        names = [m.name for m in meta]
        dtypes = [str(m.dtype).removeprefix("torch.") for m in meta]
        shapes = [list(m.shape) for m in meta]
        broadcast.check_metadata(names, dtypes, shapes, "weight update")
        self.client.start_weight_update()
        updated = run_bounded(lambda: self.client.update_weights(
            {"names": names, "dtype_names": dtypes, "shapes": shapes}), self.timeout + 30.0, "update_weights")
        try:
            accepted = self.group.vote(True)
        except Exception as exc:
            raise WeightBroadcastError(f"weight sync: the vote before the broadcast failed: {exc}") from exc
        if not accepted:
            updated()  # raises the generator's reason (it refused before any byte moved)
            raise WeightBroadcastError("weight sync: the generator refused the update (no reason came back)")
        def tensors():  # lazily: a partitioned source assembles each bucket as it is sent (`partitions.py`)
            for (name, tensor), m in zip(self.source, meta, strict=True):
                if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != m.shape:
                    raise ValueError(f"WeightSource iteration disagrees with its metadata at {name!r}")
                yield tensor

        try:
            broadcast.send_packed(self.group, tensors(), self.bucket_bytes)
        except ValueError:
            raise
        except Exception as exc:
            raise WeightBroadcastError(f"weight sync: broadcasting the weights failed or timed out "
                                       f"({self.timeout:.0f}s): {exc}") from exc
        updated()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def register() -> None:
    """Make `BACKEND` known to both of vLLM's registries in this process (`vllm_shm_engine.register_backend`)."""
    register_backend(BACKEND, GlooWeightTransferEngine, GlooTrainerWeightTransferEngine)


register()
