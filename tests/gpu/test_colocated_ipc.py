"""Colocated mode's "ipc" weight transport on one GPU: learner rank 0 (this process) publishes a device copy of new
weights as CUDA IPC handles; a generator process on the same GPU (the transformers backend: the GPU machine has no
vLLM) maps and loads them, and its logits equal the learner's. Then a whole colocated run: the learner and one
generator on cuda:0. `pytest -m gpu`."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _generator(model_dir: str, inbox, outbox) -> None:
    from async_rlhf.generation.engine.hf_backend import HFBackend

    backend = HFBackend(model_dir, device="cuda:0")
    update = inbox.get(timeout=120)
    backend.load_weights(update)
    ids = torch.tensor([[1, 2, 3, 4, 5]], device="cuda:0")
    with torch.no_grad():
        # as numpy: a CPU tensor would travel as a shared-memory file descriptor served by this process, which exits
        outbox.put(backend.model(ids).logits.cpu().numpy())
    backend.close()


def test_ipc_weights_reach_a_generator_on_the_same_gpu(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from async_rlhf.weight_sync import gather_full_state
    from async_rlhf.weight_sync.ipc import IpcWeightTransport

    device = torch.device("cuda:0")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    transport = IpcWeightTransport(device)
    update = transport.publish(gather_full_state(model, True, device=device), version=1)
    assert update.transport == "ipc" and len(update.ipc_handles) == len(update.names)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_generator, args=(tiny_model_dir, inbox, outbox), daemon=True)
    proc.start()
    try:
        inbox.put(update)
        logits = outbox.get(timeout=300)
    finally:
        proc.join(60)
        transport.close()
    with torch.no_grad():
        expected = model(torch.tensor([[1, 2, 3, 4, 5]], device=device)).logits.cpu()
    torch.testing.assert_close(torch.from_numpy(logits), expected)
    assert transport.stats()["sync/ipc_held_versions"] == 0


def test_a_colocated_run_trains_on_one_gpu(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "recipes/online_dpo.py", "--task", "toy", "--max_steps", "4", "--output_dir", str(out),
           "--generator_devices", "cuda:0", "--colocate", "true", "--generator_backend", "transformers",
           "--report_to", "none"]
    done = subprocess.run(cmd, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 4


def test_cuda_learners_leave_cudnn_attention_off_unless_asked(tmp_path, tiny_run_config):
    """cuDNN's attention plans anew for every sequence shape (most of a learner step on the built-in task, measured
    on an H100); the learner turns it off unless `cudnn_attention` asks for it."""
    from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
    from async_rlhf.data.tiny_model import save_tiny_model
    from async_rlhf.trainers.online_dpo import AsyncOnlineDPOTrainer

    model_dir = save_tiny_model(str(tmp_path / "model"))
    for ask in (False, True):
        config = tiny_run_config(tmp_path / f"out-{ask}", max_steps=1, generator_devices=["cuda:0"], colocate=True,
                                 cudnn_attention=ask)
        trainer = AsyncOnlineDPOTrainer(model=model_dir, reward_funcs=lowercase_reward, args=config,
                                        train_dataset=toy_prompts(8))
        trainer.train()
        assert torch.backends.cuda.cudnn_sdp_enabled() is ask
