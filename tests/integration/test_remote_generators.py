"""Remote generators on loopback: vLLM's OpenAI server started by `python -m async_rlhf.generation.serve` as its own
process (as an operator would), a trainer that drives it over HTTP by address (requests in, version-tagged rollouts
out, weights through vLLM's weight routes as shm files), weights loaded under a running request (`weight_load="in_flight"`: vLLM's
pause with keep, per-token versions) or after it ("drain"), a trainer with the wrong token refused naming the server,
and a server killed mid-run failing the run naming it.

One server serves the whole module (vLLM on CPU takes 20-40 s to start); each test is one trainer session. The
runs are read back from their own records (run_summary.json, metrics.jsonl), like the local end-to-end test.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.data.tiny_model import save_tiny_model
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.errors import GeneratorFailed
from async_rlhf.generation.serve import READY_LINE, TOKEN_ENV
from run_records import check_staleness_records
from session_run import stop_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_server(model_dir: str, token: str) -> tuple[subprocess.Popen, str, list[str]]:
    """A generator server process; returns it, its address and its log so far (kept filling by a thread)."""
    env = {**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "async_rlhf.generation.serve", "--model", model_dir, "--port", "0",
           "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]
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
            line = lines.get(timeout=300)  # vLLM engine start: 20-40 s here, much more on a busy machine
            assert line is not None, "server exited before it was ready:\n" + "".join(log[-50:])
            if line.startswith(READY_LINE):
                return proc, line[len(READY_LINE):].split()[0].removeprefix("http://"), log
    except queue.Empty:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("server not ready within 300 s:\n" + "".join(log[-50:])) from None


def stop_server(proc: subprocess.Popen, log: list[str]) -> None:
    if not stop_group(proc, 60):
        raise AssertionError("server did not stop within 60 s of SIGTERM:\n" + "".join(log[-50:]))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(address, token, model dir, process) of a running vLLM server; stopped (SIGTERM) after the module."""
    pytest.importorskip("vllm")
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("server_model")))
    token = secrets.token_hex(16)
    t0 = time.monotonic()
    proc, address, log = start_server(model_dir, token)
    print(f"vLLM server ready in {time.monotonic() - t0:.1f} s")
    yield address, token, model_dir, proc
    stop_server(proc, log)


def _train(tmp_path, address: str, model_dir: str, staleness: int, steps: int, reward=lowercase_reward,
           timeout: float = 120) -> tuple[dict, list[dict]]:
    config = AsyncOnlineDPOConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, num_generations=2,
        max_new_tokens=8, max_length=48, generator_servers=[address], max_staleness=staleness, learning_rate=1e-2,
        lr_scheduler_type="constant", temperature=1.0, disable_tqdm=True, seed=0, generator_start_timeout=timeout,
        weight_sync_timeout=timeout, rollout_timeout=timeout)
    trainer = AsyncOnlineDPOTrainer(model_dir, reward_funcs=reward, args=config, train_dataset=toy_prompts(64))
    trainer.train()
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary, [m for m in metrics if "loss" in m]


def test_online_dpo_against_a_remote_server(server, tmp_path, monkeypatch):
    address, token, model_dir, _ = server
    monkeypatch.setenv(TOKEN_ENV, token)
    steps = 5
    summary, logged = _train(tmp_path, address, model_dir, staleness=1, steps=steps)
    assert summary["steps"] == steps
    staleness = check_staleness_records(tmp_path, steps, 1, summary, dropped=0)
    assert max(staleness) == 1, f"max_staleness=1 never overlapped generation with training: {staleness}"
    assert summary["regenerated"] == 0
    # weights went through vLLM's weight routes and the server loaded them: its version advanced with the learner's
    assert summary["sync_bytes"] > 0
    assert summary["generator_versions"]["0"] == steps  # the trainer waits for the last acknowledgement
    assert [m["step"] for m in logged] == list(range(1, steps + 1))
    assert logged[-1]["generator/version_loaded"] >= steps - 2  # what the server had acknowledged at that log
    import requests

    info = requests.get(f"http://{address}/weight_info", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert info.json()["weight_version"] == str(steps)  # vLLM's own record of the version: ours


@pytest.mark.slow  # a second remote run; the default suite keeps the S=1 run, the token check and the kill
def test_served_logprobs_equal_the_learner_logprobs(server, tmp_path, monkeypatch):
    """At staleness 0 every batch is sampled by exactly the learner's weights, so the behaviour log-probs the
    server returns must equal the learner's own (float32 on both sides). Runs after the S=1 run, so the server
    starts with other weights loaded and the pool must push the trainer's starting policy first."""
    address, token, model_dir, _ = server
    monkeypatch.setenv(TOKEN_ENV, token)
    summary, logged = _train(tmp_path, address, model_dir, staleness=0, steps=3)
    assert check_staleness_records(tmp_path, 3, 0, summary, dropped=0) == [0, 0, 0]
    for m in logged:
        for key in ("off_policy/chosen_log_ratio_abs_max", "off_policy/rejected_log_ratio_abs_max"):
            assert m[key] < 1e-3, (m["step"], key, m[key])


def _wait_until_running(pool, address: str, token: str, count: int, timeout: float = 60) -> None:
    """Until vLLM's own gauge says `count` requests are in its running batch (its Prometheus `/metrics`)."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool.check()
        text = requests.get(f"http://{address}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
        running = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:num_requests_running{")]
        if running and running[0] >= count:
            return
        time.sleep(0.005)
    raise AssertionError(f"{count} requests not running on the server within {timeout:.0f} s")


@pytest.mark.parametrize("weight_load", ["in_flight", "drain"])
def test_weights_load_under_a_running_request_only_in_flight(server, tmp_path, weight_load):
    """Two long greedy samples are running (vLLM's own gauge says so) when weights v1 are sent. "in_flight": the
    server loads at once (pause with keep, load, resume): each sample's first tokens carry version 0 and its later
    ones version 1, and the rollout's policy_version is its oldest token's, 0. "drain": the load waits for the
    request (acknowledged after the rollout), every token is version 0."""
    from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool
    from async_rlhf.types import GenerationRequest, SamplingSettings
    from async_rlhf.weight_sync import ShmWeightTransport
    from async_rlhf.weight_sync.safetensors_io import state_from_model_dir

    address, token, model_dir, _ = server
    events, rollouts = [], []

    def on_rollouts(batch):
        events.append("rollout")
        rollouts.append(batch)

    transport = ShmWeightTransport(str(tmp_path))
    pool = HTTPGeneratorPool([address], on_rollouts, transport, model_dir, initial_version=0, start_timeout=300,
                             weight_sync_timeout=120, request_timeout=120, token=token, weight_load=weight_load)
    try:
        pool.start()  # an earlier test left other weights loaded: the pool pushes version 0 first
        settings = SamplingSettings(max_new_tokens=200, temperature=0.0, top_p=1.0, top_k=0, n=1, seed=None)
        pool.send_request(0, GenerationRequest(0, [0, 1], [[2, 40, 41], [3, 50]], settings))
        _wait_until_running(pool, address, token, 2)
        state = {k: v * 1.01 for k, v in state_from_model_dir(model_dir).items()}
        pool.send_weights(transport.publish(state, 1))
        deadline = time.monotonic() + 120
        while not (rollouts and "ack" in events) and time.monotonic() < deadline:
            pool.check()
            if not pool.acks.waiting() and "ack" not in events:
                events.append("ack")
            time.sleep(0.005)
        assert rollouts and not pool.acks.waiting(), "no rollout or acknowledgement within 120 s"
    finally:
        pool.close()
        transport.close()
    (batch,) = rollouts
    starts = [c.version_starts for group in batch.completions for c in group]
    lengths = [len(c.token_ids) for group in batch.completions for c in group]
    assert batch.policy_version == 0, (batch.policy_version, starts, lengths, events)
    if weight_load == "in_flight":  # loaded while both were running: tokens of both versions in each
        assert all(s[0] == [0, 0] and s[-1][0] == 1 and s[-1][1] > 0 for s in starts), (starts, lengths, events)
    else:
        assert events == ["rollout", "ack"], (events, starts, lengths)
        assert all(s == [[0, 0]] for s in starts), (starts, lengths, events)


def test_wrong_token_is_refused_naming_the_server(server, tmp_path, monkeypatch):
    address, token, model_dir, _ = server
    monkeypatch.setenv(TOKEN_ENV, "not-" + token)
    with pytest.raises(GeneratorFailed, match=rf"generator server 0 \({address}\) /health: refused the token"):
        _train(tmp_path, address, model_dir, staleness=1, steps=2)
    import requests

    for route in ("/update_weights", "/start_weight_update", "/pause", "/collective_rpc", "/v1/completions"):
        assert requests.post(f"http://{address}{route}", json={}, timeout=30).status_code == 401, route
    assert requests.get(f"http://{address}/health", timeout=30).status_code == 401


def test_a_server_that_dies_fails_the_run_naming_it(server, tmp_path, monkeypatch):
    """The server is killed (SIGKILL) while the trainer runs: the run fails within seconds, naming the server, instead
    of waiting for rollouts that will never come. Last in the module: it kills the module's server."""
    address, token, model_dir, proc = server
    monkeypatch.setenv(TOKEN_ENV, token)
    calls = []

    def reward_that_kills_the_server(prompts, completions, **kwargs):
        calls.append(time.monotonic())
        if len(calls) == 3:  # during the third step
            os.killpg(proc.pid, signal.SIGKILL)
        return lowercase_reward(prompts, completions, **kwargs)

    with pytest.raises(GeneratorFailed, match=rf"generator server 0 \({address}\) failed"):
        _train(tmp_path / "run", address, model_dir, staleness=1, steps=50, reward=reward_that_kills_the_server,
               timeout=60)
    assert time.monotonic() - calls[2] < 60, "the failure took longer than a minute to surface"
