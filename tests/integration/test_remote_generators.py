"""Remote generators on loopback: a vLLM generator server started as its own process (as on another node), a
trainer that connects to it by address, sends requests, receives version-tagged rollouts and pushes its weights
over a gloo broadcast group; and a trainer with the wrong token, refused.

One server serves the whole module (vLLM on CPU takes 20-50 s to start); each test is one trainer session. The
runs are read back from their own records (run_summary.json, metrics.jsonl), like the local end-to-end test.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading

import pytest

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.generation import wire
from async_rlhf.generation.pool_protocol import GeneratorFailed
from async_rlhf.generation.server import READY_LINE
from async_rlhf.data.tiny_model import save_tiny_model
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from run_records import check_staleness_records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(address, token, model dir) of a running vLLM generator server; stopped (SIGTERM) after the module."""
    pytest.importorskip("vllm")
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("server_model")))
    token = secrets.token_hex(16)
    proc, address, log = _start_server(model_dir, token, "--dtype", "float32", "--kv_cache_memory_mb", "64")
    yield address, token, model_dir
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError("server did not stop within 60 s of SIGTERM:\n" + "".join(log[-50:]))


def _start_server(model_dir: str, token: str, *extra: str) -> tuple[subprocess.Popen, str, list[str]]:
    """A generator server process; returns it, its address and its log so far (kept filling by a thread)."""
    env = {**os.environ, wire.TOKEN_ENV: token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "async_rlhf.generation.server", "--model", model_dir, "--port", "0",
           "--threads", "1", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    log: list[str] = []

    def pump():
        for line in proc.stdout:
            log.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=300)  # vLLM engine start: 20-50 s here, much more on a busy machine
            assert line is not None, "server exited before it was ready:\n" + "".join(log[-50:])
            if line.startswith(READY_LINE):
                return proc, line[len(READY_LINE):].split()[0], log
    except queue.Empty:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("server not ready within 300 s:\n" + "".join(log[-50:])) from None


def _train(tmp_path, address: str, model_dir: str, staleness: int, steps: int, reward=lowercase_reward
           ) -> tuple[dict, list[dict]]:
    config = AsyncOnlineDPOConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, num_generations=2,
        max_new_tokens=8, max_length=48, generator_servers=[address], max_staleness=staleness, learning_rate=1e-2,
        lr_scheduler_type="constant", temperature=1.0, disable_tqdm=True, seed=0, generator_start_timeout=120,
        weight_sync_timeout=120, rollout_timeout=120)
    trainer = AsyncOnlineDPOTrainer(model_dir, reward_funcs=reward, args=config,
                                    train_dataset=toy_prompts(64))
    trainer.train()
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, [m for m in metrics if "loss" in m]


def test_online_dpo_against_a_remote_server(server, tmp_path, monkeypatch):
    address, token, model_dir = server
    monkeypatch.setenv(wire.TOKEN_ENV, token)
    steps = 5
    summary, logged = _train(tmp_path, address, model_dir, staleness=1, steps=steps)
    assert summary["steps"] == steps
    staleness = check_staleness_records(tmp_path, steps, 1, summary, dropped=0)
    assert max(staleness) == 1, f"max_staleness=1 never overlapped generation with training: {staleness}"
    assert summary["regenerated"] == 0
    # weights went over the broadcast group and the server loaded them: its version advanced with the learner's
    assert summary["sync_bytes"] > 0
    assert summary["generator_versions"]["0"] == steps  # the trainer waits for the last acknowledgement
    assert [m["step"] for m in logged] == list(range(1, steps + 1))
    assert logged[-1]["generator/version_loaded"] >= steps - 2  # what the server had acknowledged at that log


@pytest.mark.slow  # a second remote run; the default suite keeps the S=1 run and the token check
def test_broadcast_weights_equal_the_learner_weights(server, tmp_path, monkeypatch):
    """At staleness 0 every batch is sampled by exactly the learner's weights, so the behaviour log-probs the
    server returns must equal the learner's own (float32 on both sides): any corruption on the way shows here."""
    address, token, model_dir = server
    monkeypatch.setenv(wire.TOKEN_ENV, token)
    summary, logged = _train(tmp_path, address, model_dir, staleness=0, steps=3)
    assert check_staleness_records(tmp_path, 3, 0, summary, dropped=0) == [0, 0, 0]
    for m in logged:
        for key in ("off_policy/chosen_log_ratio_abs_max", "off_policy/rejected_log_ratio_abs_max"):
            assert m[key] < 1e-3, (m["step"], key, m[key])


def test_wrong_token_is_refused(server, tmp_path, monkeypatch):
    address, token, model_dir = server
    monkeypatch.setenv(wire.TOKEN_ENV, "not-" + token)
    with pytest.raises(GeneratorFailed, match="unauthorized: wrong or missing token"):
        _train(tmp_path, address, model_dir, staleness=1, steps=2)
    # a bare connection without any token, and one that sends pickle instead of JSON, are refused as well
    host, port = wire.parse_address(address)
    with socket.create_connection((host, port), timeout=30) as sock:
        wire.send_frame(sock, {"kind": "hello", "protocol": wire.PROTOCOL})
        reply = wire.recv_frame(sock)
    assert reply["kind"] == "error" and "unauthorized" in reply["message"]
    with socket.create_connection((host, port), timeout=30) as sock:
        body = b"\x80\x04\x95" + b"\x00" * 16  # the start of a pickle
        sock.sendall(len(body).to_bytes(4, "big") + body)
        with pytest.raises((wire.ConnectionClosed, ConnectionResetError)):
            wire.recv_frame(sock)  # dropped without an answer: it was not JSON


@pytest.mark.slow  # starts its own vLLM server
def test_a_server_that_dies_fails_the_run_naming_it(tmp_path, monkeypatch):
    """The server is killed (SIGKILL) while the trainer runs: the run fails within seconds, naming the server, instead
    of waiting for rollouts that will never come. (A transformers-backend server: starts in seconds; the failure
    handling is the trainer's, the same for any engine.)"""
    import time

    model_dir = save_tiny_model(str(tmp_path / "model"))
    monkeypatch.setenv(wire.TOKEN_ENV, "t0ken")
    proc, address, log = _start_server(model_dir, "t0ken", "--backend", "transformers")
    calls = []

    def reward_that_kills_the_server(prompts, completions, **kwargs):
        calls.append(time.monotonic())
        if len(calls) == 3:  # during the third step
            os.killpg(proc.pid, signal.SIGKILL)
        return lowercase_reward(prompts, completions, **kwargs)

    try:
        with pytest.raises(GeneratorFailed, match=f"generator server.*{address}"):
            _train(tmp_path / "run", address, model_dir, staleness=1, steps=50, reward=reward_that_kills_the_server)
        assert time.monotonic() - calls[2] < 60, "the failure took longer than a minute to surface"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
