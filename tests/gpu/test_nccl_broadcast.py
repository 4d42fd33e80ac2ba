"""The broadcast weight transport over NCCL: the code of tests/integration/test_weight_broadcast.py with the other
backend, learner rank 0 on cuda:0 and a generator process on cuda:1 (NCCL needs one GPU per member). Needs 2 GPUs:
`pytest -m gpu`. (Remote vLLM servers no longer use this transport: see generation/pool/http_pool.py.)"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from async_rlhf.types import WeightUpdate
from async_rlhf.weight_sync.broadcast import BroadcastWeightTransport, GroupInfo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def _generator(model_dir: str, info: dict, update: dict, out: str) -> None:
    torch.cuda.set_device(1)
    from safetensors.torch import save_file

    from async_rlhf.generation.engine.hf_backend import HFBackend

    backend = HFBackend(model_dir, device="cuda:1")
    backend.join_weight_group(GroupInfo.from_dict(info))
    backend.load_weights(WeightUpdate(**update))
    save_file({k: v.cpu().contiguous() for k, v in backend.model.state_dict().items()}, out)
    backend.close()


def test_nccl_broadcast_loads_the_weights_exactly(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.cuda.set_device(0)
    state = {k: v + 1.0 for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()}
    transport = BroadcastWeightTransport("nccl", timeout=120)
    transport.listen("127.0.0.1")
    update = dict(version=1, transport="broadcast", names=list(state), dtypes=["float32"] * len(state),
                  shapes=[list(t.shape) for t in state.values()])
    proc = mp.get_context("spawn").Process(
        target=_generator, args=(tiny_model_dir, transport.member_info(1, 2).to_dict(), update,
                                 str(tmp_path / "loaded.safetensors")), daemon=True)
    proc.start()
    try:
        transport.open(world_size=2)
        transport.publish(state, 1)
        transport.wait_sent(1, timeout=120)
        proc.join(120)
        assert proc.exitcode == 0
    finally:
        transport.close()
    loaded = load_file(str(tmp_path / "loaded.safetensors"))
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
