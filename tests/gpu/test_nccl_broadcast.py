"""The broadcast weight transport over NCCL: the code of tests/integration/test_weight_broadcast.py with the other
backend, learner rank 0 on cuda:0 and a generator process on cuda:1 (NCCL needs one GPU per member); and a
remote vLLM generator server on cuda:1 trained against over NCCL. Needs 2 GPUs: `pytest -m gpu`."""

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

    from async_rlhf.generation.hf_backend import HFBackend

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


def test_remote_vllm_server_on_gpu_over_nccl(tiny_model_dir, tmp_path, monkeypatch):
    """Learner on cuda:0, a vLLM generator server on cuda:1, weights by NCCL broadcast, staleness 0: behaviour
    log-probs equal the learner's (float32), so the weights arrived intact."""
    import json
    import signal
    import subprocess
    import sys

    from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
    from async_rlhf.generation.server import READY_LINE
    from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "async_rlhf.generation.server", "--model", tiny_model_dir,
                             "--port", "0", "--dtype", "float32", "--gpu_memory_utilization", "0.3"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        address = None
        for line in proc.stdout:
            if line.startswith(READY_LINE):
                address = line[len(READY_LINE):].split()[0]
                break
        assert address, "server exited before it was ready"
        config = AsyncOnlineDPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                      max_new_tokens=8, max_length=48, generator_servers=[address], max_staleness=0,
                                      weight_broadcast_backend="nccl", disable_tqdm=True, seed=0)
        trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                                        train_dataset=toy_prompts(64))
        trainer.train()
        assert trainer.run_summary["generator_versions"]["0"] == 3
        logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert all(m["off_policy/chosen_log_ratio_abs_max"] < 1e-3 for m in logged if "loss" in m)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
