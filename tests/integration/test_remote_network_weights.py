"""A generator server that cannot see learner rank 0's /dev/shm: started with `unshare --mount` and a private tmpfs
on /dev/shm (what a server on another host looks like to the learner). The pool recognises it without a flag (it
cannot read the learner's probe file) and sends every version over the network: our `async_rlhf_gloo` backend
through vLLM's `/init_weight_transfer_engine` and `/update_weights` routes, a gloo group on loopback.

Checks: a run trains to the end with every version loaded and, at max_staleness 0, the server's behaviour log-probs
equal the learner's; its per-sample staleness records hold; the rendezvous refuses a wrong token at once; forcing
'shm' on such a server is refused naming it; a stopped-and-resumed run matches an uninterrupted one loss for loss; a server killed mid-broadcast fails the run naming it, within the
timeout, with no process left. Needs root (unshare); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time

import pytest
from run_records import check_staleness_records
from stop_at import check_resume_matches
from test_remote_generators import start_server, stop_server

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.data.tiny_model import save_tiny_model
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.errors import GeneratorFailed
from async_rlhf.generation.serve import TOKEN_ENV


def _can_unshare() -> bool:
    if not shutil.which("unshare") or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


# slow: the server's start under unshare and three runs take 2-4 min on 2 busy cores (the in-process network checks
# of test_network_weights.py stay in the default tier)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --mount (a private /dev/shm)")]


@pytest.fixture(scope="module")
def private_server(tmp_path_factory):
    """(address, token, model dir, process) of a server whose /dev/shm is a private tmpfs."""
    pytest.importorskip("vllm")
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("private_server_model")))
    token = secrets.token_hex(16)
    proc, address, log = start_server(model_dir, token, private_shm=True)
    yield address, token, model_dir, proc
    if proc.poll() is None:
        stop_server(proc, log)


def _config(tmp_path, address: str, staleness: int, steps: int, timeout: float = 120, **fields):
    return AsyncOnlineDPOConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4, num_generations=2,
        max_new_tokens=8, max_length=48, generator_servers=[address], max_staleness=staleness, learning_rate=1e-2,
        lr_scheduler_type="constant", temperature=1.0, disable_tqdm=True, seed=0, generator_start_timeout=timeout,
        weight_sync_timeout=timeout, rollout_timeout=timeout, **fields)


def test_private_shm_server_trains_over_the_network_logprobs_equal(private_server, tmp_path, monkeypatch):
    address, token, model_dir, _ = private_server
    monkeypatch.setenv(TOKEN_ENV, token)
    steps = 3
    trainer = AsyncOnlineDPOTrainer(model_dir, reward_funcs=lowercase_reward, train_dataset=toy_prompts(64),
                                    args=_config(tmp_path, address, staleness=0, steps=steps))
    trainer.train()
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "loss" in m]
    assert summary["steps"] == steps
    assert summary["generator_versions"]["0"] == steps  # every version loaded (the last one acknowledged at the end)
    assert check_staleness_records(tmp_path, steps, 0, summary, dropped=0) == [0] * steps
    assert any("sync/network_send_seconds" in m for m in metrics), "no version went over the network"
    for m in logged:  # sampled by exactly the learner's weights: the server's log-probs are the learner's
        for key in ("off_policy/chosen_log_ratio_abs_max", "off_policy/rejected_log_ratio_abs_max"):
            assert m[key] < 1e-3, (m["step"], key, m[key])
    import requests

    info = requests.get(f"http://{address}/weight_info", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert info.json()["weight_version"] == str(steps)


def test_rendezvous_refuses_a_wrong_token_and_forced_shm(private_server, tmp_path, monkeypatch):
    from async_rlhf.config.checks import base_url
    from async_rlhf.generation.pool.http_client import Unauthorized, WeightSyncClient
    from async_rlhf.weight_sync.network import NetworkSender

    address, token, model_dir, _ = private_server
    sender = NetworkSender(WeightSyncClient(base_url(address), "not-" + token, 60), workers=1, timeout=60)
    t0 = time.monotonic()
    with pytest.raises(Unauthorized, match="/init_weight_transfer_engine: refused the token"):
        sender.open()
    assert time.monotonic() - t0 < 30  # refused at once, not after the group's timeout
    monkeypatch.setenv(TOKEN_ENV, token)
    with pytest.raises(GeneratorFailed, match=rf"weight_transport='shm' but generator server 0 \({address}\) cannot "
                                              "read learner rank 0's shm_dir"):
        AsyncOnlineDPOTrainer(model_dir, reward_funcs=lowercase_reward, train_dataset=toy_prompts(64),
                              args=_config(tmp_path, address, staleness=1, steps=2, weight_transport="shm")).train()


def test_stopped_and_resumed_run_on_a_private_shm_server_matches_an_uninterrupted_one(private_server, tmp_path,
                                                                                       monkeypatch):
    """The resumed run's first version (the checkpoint's) reaches the server over the network before any request,
    and training goes on loss for loss as if never stopped (at max_staleness 0 each batch is sampled by exactly the
    version that trains on it, with seeded requests)."""
    address, token, model_dir, _ = private_server
    monkeypatch.setenv(TOKEN_ENV, token)
    data = toy_prompts(64)
    check_resume_matches(lambda out: AsyncOnlineDPOTrainer(
        model_dir, reward_funcs=lowercase_reward, train_dataset=data,
        args=_config(out, address, staleness=0, steps=4, save_strategy="steps", save_steps=2)), tmp_path, steps=4, stop=2)
    summary = json.loads((tmp_path / "cut" / "run_summary.json").read_text())
    assert summary["generator_places"]["0"]["weights"] == "network", summary["generator_places"]


def test_server_killed_mid_broadcast_fails_the_run_naming_it(private_server, tmp_path, monkeypatch):
    """The server is SIGKILLed after it has accepted a version's metadata and rank 0 starts sending its bytes: the
    run fails naming the server within the timeout, and nothing of the server is left. Last: it kills the server."""
    from async_rlhf.weight_sync import broadcast

    address, token, model_dir, proc = private_server
    monkeypatch.setenv(TOKEN_ENV, token)
    send_packed, killed, rewards = broadcast.send_packed, [], []

    def kill_then_send(group, tensors, bucket_bytes):
        if len(killed) == 0 and rewards:  # a version after training began (the first one goes through)
            os.killpg(proc.pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return send_packed(group, tensors, bucket_bytes)

    def reward(prompts, completions, **kwargs):
        rewards.append(1)
        return lowercase_reward(prompts, completions, **kwargs)

    monkeypatch.setattr(broadcast, "send_packed", kill_then_send)
    timeout = 60
    with pytest.raises(GeneratorFailed, match=rf"generator server 0 \({address}\) failed: .*loading weights v\d+ "
                                              r"\(network\)"):
        AsyncOnlineDPOTrainer(model_dir, reward_funcs=reward, train_dataset=toy_prompts(64),
                              args=_config(tmp_path, address, staleness=1, steps=50, timeout=timeout)).train()
    assert killed and time.monotonic() - killed[0] < timeout, "the failure took longer than the timeout"
    proc.wait(30)
    deadline = time.monotonic() + 30  # SIGKILLed children take a moment to be reaped
    while (leftover := subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
           ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftover, f"server processes left: {leftover}"
