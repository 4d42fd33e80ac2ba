"""Generators as Ray actors on another node of a Ray cluster (`generator_launcher='ray'`, `ray_launcher.py`).

The cluster is two Ray nodes started on this machine: the head, where learner rank 0 (this test process) connects,
with no CPUs to give, and a second node with 2 CPUs started under `unshare --mount` with a private tmpfs on
`/dev/shm`, so a generator placed there cannot read rank 0's shm files, as on another host. Ray places every
generator on the second node (the only one with CPUs); `weight_transport` 'auto' sees a cluster with a node besides
rank 0's and sends the weights over the network (a gloo group per actor, joined through its inbox). Ray's token
authentication is on (the token in the environment of every process, none written to ~/.ray).

Checks: a run trains to the end at max_staleness 0 with every version loaded, the generator's log-probs equal the
learner's and the per-sample staleness records hold; an actor killed mid-broadcast is replaced by Ray on the second
node, joins a new group at the next version and the run completes; a stopped-and-resumed run matches an
uninterrupted one loss for loss. Needs Ray (requirements-ray.txt), root and unshare; skipped otherwise. Slow: the
cluster's start (20 s) and one vLLM engine per run.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from mid_broadcast import train_killing_mid_broadcast
from run_records import check_staleness_records
from stop_at import check_resume_matches

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.config.checks import ray_installed
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts


def _can_unshare() -> bool:
    if not shutil.which("unshare") or os.geteuid() != 0:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False).returncode == 0


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not ray_installed(), reason="Ray is not installed (pip install -r requirements-ray.txt)"),
              pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare --mount (a private /dev/shm)")]

SECOND_NODE = ("mount -t tmpfs -o size=2g tmpfs /dev/shm && exec ray start --address {address} --num-cpus 2 "
               "--disable-usage-stats --block")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive_nodes(address: str, env: dict) -> list[dict]:
    code = (f"import json, ray; ray.init(address={address!r}, log_to_driver=False, configure_logging=False); "
            "print(json.dumps([{'id': n['NodeID'], 'cpus': n['Resources'].get('CPU', 0)} for n in ray.nodes() "
            "if n['Alive']]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         check=False)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else []


@pytest.fixture(scope="module")
def two_node_ray(tmp_path_factory):
    """(address, head node id, token environment) of a two-node Ray cluster on this machine (see the module
    docstring), with Ray's token authentication on and the token in the environment (no ~/.ray/auth_token written)."""
    pytest.importorskip("vllm")
    logs = tmp_path_factory.mktemp("ray_cluster")
    address = f"127.0.0.1:{_free_port()}"
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env = {**os.environ, **auth}
    procs, logs_open = [], []
    try:
        head = ["ray", "start", "--head", "--num-cpus", "0", "--port", address.split(":")[1],
                "--include-dashboard", "false", "--disable-usage-stats", "--block"]
        logs_open.append(open(logs / "head.log", "w"))  # noqa: SIM115 (closed at teardown)
        procs.append(subprocess.Popen(head, stdout=logs_open[-1], stderr=subprocess.STDOUT, start_new_session=True,
                                      env=env))
        deadline = time.monotonic() + 120
        while not _alive_nodes(address, env):
            assert time.monotonic() < deadline, f"Ray head not up within 120 s: {(logs / 'head.log').read_text()}"
            time.sleep(2)
        logs_open.append(open(logs / "node2.log", "w"))  # noqa: SIM115 (closed at teardown)
        procs.append(subprocess.Popen(["unshare", "--mount", "sh", "-c", SECOND_NODE.format(address=address)],
                                      stdout=logs_open[-1], stderr=subprocess.STDOUT, start_new_session=True, env=env))
        while len(nodes := _alive_nodes(address, env)) < 2:
            assert time.monotonic() < deadline, f"second Ray node not up within 120 s: {(logs / 'node2.log').read_text()}"
            time.sleep(2)
        head_id = next(n["id"] for n in nodes if n["cpus"] == 0)
        yield address, head_id, auth
    finally:
        for p in reversed(procs):  # `ray start --block` stops its node's processes on SIGTERM
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for f in logs_open:
            f.close()


@pytest.fixture
def config(tiny_run_config, two_node_ray, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", two_node_ray[0])
    for name, value in two_node_ray[2].items():  # the driver (this process) authenticates like the nodes
        monkeypatch.setenv(name, value)
    return functools.partial(tiny_run_config, generator_backend="vllm", generator_launcher="ray", max_staleness=0,
                             per_device_train_batch_size=4, max_new_tokens=8, generator_threads=1,
                             weight_sync_timeout=120, generator_start_timeout=600, rollout_timeout=300, seed=7)


def _logged(out) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _on_second_node(summary: dict, head_id: str) -> None:
    assert summary["generator_places"], summary
    for gid, place in summary["generator_places"].items():
        assert place["weights"] == "network", (gid, place)
        assert "not learner rank 0's node" in place["where"] and head_id[:8] not in place["where"], (gid, place)


def test_generator_on_another_node_trains_with_weights_over_the_network(tmp_path, tiny_model_dir, config,
                                                                       two_node_ray):
    steps = 3
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=toy_prompts(48),
                                    args=config(tmp_path, max_steps=steps))
    trainer.train()
    s = trainer.run_summary
    _on_second_node(s, two_node_ray[1])
    assert s["steps"] == steps
    assert check_staleness_records(tmp_path, steps, 0, s, dropped=0) == [0] * steps
    assert min(s["generator_versions"].values()) >= steps - 1  # every version a batch could need was loaded
    metrics = _logged(tmp_path)
    assert any("sync/network_send_seconds" in m for m in metrics), "no version went over the network"
    for m in (m for m in metrics if "loss" in m):  # on-policy: the generator's log-probs are the learner's
        for key in ("off_policy/chosen_log_ratio_abs_max", "off_policy/rejected_log_ratio_abs_max"):
            assert m[key] < 1e-3, (m["step"], key, m[key])


def test_actor_killed_mid_broadcast_is_replaced_and_joins_the_next_version(tmp_path, tiny_model_dir, config,
                                                                          two_node_ray, monkeypatch):
    """Kill the actor once rank 0 starts sending a version's bytes (after both voted): the send fails, the pool asks
    Ray for a new actor (placed on the second node again) with a new group, the newest version reaches it first, and
    the run completes."""
    import ray

    steps = 5
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=toy_prompts(48),
                                    args=config(tmp_path, max_steps=steps, max_staleness=1))
    killed = train_killing_mid_broadcast(
        trainer, lambda t: ray.kill(t.pipeline.pool.processes[0].actor, no_restart=True), monkeypatch)
    s = trainer.run_summary
    assert killed, "the actor was never killed mid-broadcast"
    assert s["steps"] == steps and s["generator_restarts"] == 1
    _on_second_node(s, two_node_ray[1])  # the replacement's place
    assert min(s["generator_versions"].values()) >= steps - 1  # the replacement caught up
    check_staleness_records(tmp_path, steps, 1, s, dropped=0)


def test_stopped_and_resumed_run_on_another_node_matches_an_uninterrupted_one(tmp_path, tiny_model_dir, config):
    data = toy_prompts(48)
    check_resume_matches(lambda out: AsyncOnlineDPOTrainer(
        tiny_model_dir, reward_funcs=lowercase_reward, train_dataset=data,
        args=config(out, max_steps=4, save_strategy="steps", save_steps=2)), tmp_path, steps=4, stop=2)
