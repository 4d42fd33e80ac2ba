"""The trainer side of our "async_rlhf_shm" vLLM weight-transfer backend, against a client that records its calls:
the round trip vLLM's protocol prescribes, our version as the weight version, and a file whose names differ from
its update refused before the inference side hears of it. (The worker side runs inside a real engine:
tests/integration/test_generation_backends.py.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from async_rlhf.types import WeightUpdate

pytest.importorskip("vllm")
from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient  # noqa: E402
from vllm.distributed.weight_transfer.factory import (  # noqa: E402
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from async_rlhf.weight_sync import vllm_shm_engine  # noqa: E402
from async_rlhf.weight_sync.vllm_shm_engine import BACKEND, ShmTrainerInitInfo  # noqa: E402


class RecordingClient:
    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start",))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


@pytest.fixture
def weights(tmp_path):
    path = str(tmp_path / "policy-v3.safetensors")
    save_file({"b.weight": torch.ones(2), "a.weight": torch.zeros(3, 2)}, path)
    return path


def test_registered_once_on_both_sides():
    vllm_shm_engine.register()  # a second registration is a no-op, not vLLM's "already registered"
    assert WeightTransferEngineFactory._registry[BACKEND]() is vllm_shm_engine.ShmWeightTransferEngine
    assert WeightTransferTrainerFactory._registry[BACKEND]() is vllm_shm_engine.ShmTrainerWeightTransferEngine
    assert isinstance(RecordingClient(), VLLMWeightSyncClient)


def test_send_weights_drives_the_round_trip_with_our_version(weights):
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=0), client=client)
    engine.send_weights(WeightUpdate(version=3, transport="shm", path=weights, names=["b.weight", "a.weight"]))
    engine.send_weights(WeightUpdate(version=4, transport="shm", path=weights))  # no names: the file's, sorted
    assert client.calls == [
        ("init", {}),
        ("start",), ("update", {"path": weights, "version": 3, "names": ["b.weight", "a.weight"]}), ("finish", "3"),
        ("start",), ("update", {"path": weights, "version": 4, "names": ["a.weight", "b.weight"]}), ("finish", "4"),
    ]


def test_wrong_names_are_refused_before_the_inference_side_is_called(weights):
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=0), client=client)
    with pytest.raises(ValueError, match=r"missing \['c.weight'\], unexpected \['b.weight'\]"):
        engine.send_weights(WeightUpdate(version=3, transport="shm", path=weights, names=["a.weight", "c.weight"]))
    with pytest.raises(ValueError, match="sends 'shm' updates"):
        engine.send_weights(WeightUpdate(version=3, transport="broadcast", names=["a.weight", "b.weight"]))
    assert client.calls == [("init", {})]


def test_only_rank_zero_talks_to_the_inference_side(weights):
    client = RecordingClient()
    engine = WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=1), client=client)
    engine.send_weights(WeightUpdate(version=3, transport="shm", path=weights))
    assert client.calls == []
