"""`async_rlhf_shm`: a backend for vLLM's own weight-transfer engine that loads the learner's /dev/shm file.

vLLM 0.32 updates weights through a pluggable engine (`vllm/distributed/weight_transfer/`), driven by
`init_weight_transfer_engine`, `start_weight_update`, `update_weights` and `finish_weight_update(weight_version)`:
methods of `vllm.LLM` and `AsyncLLM`, and HTTP routes of `vllm serve`. Its built-in backends (nccl, ipc, ...) all
need CUDA. This one needs none, so CI on a CPU drives the same methods, the same worker RPCs and the same
trainer-side engine as a GPU deployment. It moves no tensors itself: the learner has already written the file
(`shm.ShmWeightTransport.publish`); the update names the file, and each worker maps it into its own address space
(`safetensors_io.map_safetensors`) and hands views of it to vLLM. Both sides must be on the same host.

Two halves, as in vLLM's `vllm/distributed/weight_transfer/nccl_engine.py`:
- worker side, `ShmWeightTransferEngine`, registered with `WeightTransferEngineFactory` when the worker imports
  our extension module (`generation/engine/vllm_worker_extension.py`, named by `worker_extension_cls`), which happens
  before the worker builds the engine. Start, receive and finish are vLLM's layerwise reload, exactly as in its
  NCCL and IPC engines: `initialize_layerwise_reload`, `model.load_weights(views)`, `finalize_layerwise_reload`.
- trainer side, `ShmTrainerWeightTransferEngine`, registered with `WeightTransferTrainerFactory`.
  `send_weights(update)` takes the `WeightUpdate` that `publish` returned and drives the round trip through any
  `VLLMWeightSyncClient`: vLLM's `HTTPVLLMWeightSyncClient` for a `vllm serve` started with
  `--weight-transfer-config '{"backend": "async_rlhf_shm"}'` and our `--worker-extension-cls`
  (tests/integration/test_vllm_weight_routes.py), or `generation.engine.vllm_backend.LLMClient` for the in-process
  `vllm.LLM` of our generator processes.

Guarantees:
- The engine's weight version is ours: `finish_weight_update(str(update.version))`, so `LLM.get_weight_version()`
  and the per-token version spans vLLM attaches to outputs name the learner's policy version.
- A file whose tensor names differ from the update's is refused before `start_weight_update`, so nothing loads
  (the generator additionally checks names and shapes against its model, `VLLMBackend.load_weights`). The worker
  checks again before it loads a tensor; if that check (or opening the file) fails, it finalizes the reload with
  nothing loaded, which puts every layer's previous tensors back, then raises.
- A failure while tensors are loading leaves the model part-updated; the caller must treat the generator as
  broken (our generator process reports the error and exits).

Cost on CPU (benchmarks/weight_broadcast.py and weight_load.py, 100M-parameter fp32 Llama, 416 MB, 2 shared
cores): a load takes 0.22-0.25 s against 0.26-0.28 s for the previous path (a copying read into the worker's
`reload_weights`), and a bare `copy_` of the same bytes 0.03 s. The mapping only saves the copy out of the page
cache; the rest is vLLM's reload itself. Profiled (cProfile around one load): oneDNN re-packing the 46 linear
weights for the CPU kernels (`create_onednn_mm_handler`) 0.114 s, the weight loaders copying the file's bytes into
the re-created layers 0.061 s, `finalize_layerwise_reload` 0.017 s, Python bookkeeping most of the rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from async_rlhf.types import WeightUpdate
from async_rlhf.weight_sync.safetensors_io import map_safetensors, read_header

BACKEND = "async_rlhf_shm"


def check_file_names(path: str, names: list[str]) -> None:
    """Raise ValueError unless the safetensors file at `path` holds exactly the tensors `names`."""
    in_file = read_header(path)[0].keys()
    missing, unexpected = set(names) - in_file, in_file - set(names)
    if missing or unexpected:
        raise ValueError(f"weight file {path} differs from its update: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")


# ---------------------------------------------------------------- worker side (inside vLLM's worker process)


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the file system is the channel."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    path: str  # the safetensors file, on the worker's host
    version: int  # the learner's policy version (for messages; the engine core records it at finish)
    names: list[str] = field(default_factory=list)  # [K] every tensor in the file, HF state_dict names


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict) -> None:
        """The base class's parse -> receive -> synchronize, with the checks before anything loads: a malformed
        update, a missing file or a file whose names differ from the update's is refused with every layer put
        back as it was (vLLM has already moved them to the meta device in `start_weight_update`)."""
        try:
            try:  # not parse_update_info: a subclass (the gloo engine) takes other updates too
                info = ShmUpdateInfo(**update_info)
            except TypeError as exc:
                raise ValueError(f"invalid {BACKEND!r} update_info: {exc}") from None
            if not os.path.isfile(info.path):
                raise FileNotFoundError(f"weights v{info.version}: {info.path} does not exist in the vLLM worker "
                                        f"(backend {BACKEND!r} needs the trainer on the same host)")
            check_file_names(info.path, info.names)
        except Exception:
            self.finish_weight_update()  # nothing loaded: finalizing puts every layer's previous tensors back
            raise
        self.receive_weights(info)
        if torch.accelerator.is_available():  # CPU: nothing is asynchronous (and outside vLLM the call raises)
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(map_safetensors(update_info.path))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------- trainer side (learner rank 0, or our generator)


@dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
    """Sends per-round payloads (a published file), like vLLM's sparse engine, so it takes no `WeightSource`."""

    init_info_cls = ShmTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> ShmTrainerWeightTransferEngine:
        if source is not None:
            raise ValueError(f"backend {BACKEND!r} sends published files (send_weights(update)), not a WeightSource")
        engine = cls(client=client, is_sender=init_info.is_sender)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self, update: WeightUpdate) -> None:  # type: ignore[override]
        """Load `update` (transport "shm") into the inference side and tag it with `update.version`.

        `update.names` empty means "whatever the file holds" (a file that did not come from `publish`)."""
        if update.transport != "shm":
            raise ValueError(f"backend {BACKEND!r} sends 'shm' updates, got {update.transport!r}")
        if not self.is_sender:  # the file is on rank 0's host; other ranks have no part in this round
            return
        names = list(update.names) or sorted(read_header(update.path)[0])
        check_file_names(update.path, names)
        self.client.start_weight_update()
        self.client.update_weights({"path": update.path, "version": update.version, "names": names})
        self.client.finish_weight_update(str(update.version))


def register_backend(name: str, worker_cls: type, trainer_cls: type) -> None:
    """Make backend `name` known to both of vLLM's registries in this process (worker side, trainer side).
    Idempotent (vLLM refuses a second registration); a name taken by another class is an error."""
    for factory, cls in ((WeightTransferEngineFactory, worker_cls), (WeightTransferTrainerFactory, trainer_cls)):
        loader = factory._registry.get(name)
        if loader is None:
            factory.register_engine(name, cls)
        elif loader() is not cls:
            raise RuntimeError(f"vLLM weight-transfer backend {name!r} is registered to {loader()!r}")


def register() -> None:
    """Make `BACKEND` known to both of vLLM's registries in this process."""
    register_backend(BACKEND, ShmWeightTransferEngine, ShmTrainerWeightTransferEngine)


register()
