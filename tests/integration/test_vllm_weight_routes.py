"""Our "async_rlhf_shm" weight-transfer backend behind a real `vllm serve` (OpenAI server, CPU), driven over vLLM's
own HTTP routes by vLLM's `HTTPVLLMWeightSyncClient` and our trainer-side engine: what a learner next to a served
vLLM would run. The new policy takes effect (greedy tokens equal the transformers model's), the server's weight
version is ours, and a misnamed file is refused (by the trainer side before any route is called; by the worker,
which keeps the old weights, when sent anyway). About 35 s on 2 cores, most of it the server's start-up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file
from session_run import stop_group

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.types import WeightUpdate

requests = pytest.importorskip("requests")
pytest.importorskip("vllm")
EXTENSION = "async_rlhf.generation.engine.vllm_worker_extension.WeightSyncExtension"
PROMPT = [2, 40, 41, 42]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "1"}  # dev mode: the weight routes
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model_dir, "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes",
           str(64 << 20), "--weight-transfer-config", '{"backend": "async_rlhf_shm"}', "--worker-extension-cls",
           EXTENSION, "--generation-config", "vllm"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, f"vLLM server exited with {proc.returncode}"
            assert time.monotonic() < deadline, "vLLM server not healthy within 300 s"
            try:
                if requests.get(url + "/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        yield url, tiny_model_dir
    finally:
        stop_group(proc, 60)


def greedy(url: str, model: str) -> list[int]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True}
    response = requests.post(url + "/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


@torch.no_grad()
def reference_greedy(model) -> list[int]:
    ids, eos = list(PROMPT), char_tokenizer().eos_token_id
    for _ in range(8):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == eos:
            break
    return ids[len(PROMPT):]


@pytest.mark.slow  # 40 s of `vllm serve` start-up; the same backend behind our server is default-tier in
# test_remote_generators.py
def test_weights_over_vllms_routes(server, tmp_path):
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from async_rlhf.weight_sync.vllm_shm_engine import ShmTrainerInitInfo

    url, model_dir = server
    client = HTTPVLLMWeightSyncClient(url)
    engine = WeightTransferTrainerFactory.trainer_init(ShmTrainerInitInfo(rank=0), client=client)
    new = tiny_llama(char_tokenizer(), seed=1).eval()  # the architecture of `tiny_model_dir`
    path = str(tmp_path / "policy-v3.safetensors")
    save_file(new.state_dict(), path)
    before = greedy(url, model_dir)

    engine.send_weights(WeightUpdate(version=3, transport="shm", path=path, names=list(new.state_dict())))
    assert requests.get(url + "/weight_info", timeout=30).json()["weight_version"] == "3"
    after = greedy(url, model_dir)
    assert after != before and after == reference_greedy(new)

    state = new.state_dict()
    state["lm_head.wrong"] = state.pop("lm_head.weight")
    wrong = str(tmp_path / "wrong.safetensors")
    save_file(state, wrong)
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\], unexpected \['lm_head.wrong'\]"):
        engine.send_weights(WeightUpdate(version=4, transport="shm", path=wrong, names=list(new.state_dict())))
    client.start_weight_update()  # straight to the routes: the worker refuses it and keeps the v3 weights
    with pytest.raises(requests.HTTPError):
        client.update_weights({"path": wrong, "version": 4, "names": list(new.state_dict())})
    assert requests.get(url + "/weight_info", timeout=30).json()["weight_version"] == "3"
    assert greedy(url, model_dir) == after
