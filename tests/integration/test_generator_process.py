"""How a generator process ends: never orphaned, never held up by an unread rollout, never by Ctrl-C (issue 23).

Each test spawns one real generator (`generator_main`, transformers backend, tiny model: a few seconds to start)
and gives it a rollout of more than a megabyte that nobody reads, the case where Python's exit used to block on
the outbox's feeder thread for good.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest
from generator_parent import request, start_generator, wait_until_rollout_is_sent
from session_run import ROOT, log_tail, start_logged


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_generator_dies_with_its_parent_despite_an_unread_big_rollout(tmp_path, tiny_model_dir):
    # the parent stands in for learner rank 0: it spawns the generator, has it send a 1.2 MiB rollout it never reads
    # (generator_parent.py), and is then SIGKILLed
    log = tmp_path / "parent.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    parent = start_logged([sys.executable, os.path.join(ROOT, "tests/integration/generator_parent.py"),
                           tiny_model_dir, str(tmp_path)], log, env=env)
    pid_file = tmp_path / "generator.pid"
    generator_pid = None
    try:
        deadline = time.monotonic() + 180
        while not pid_file.exists():
            assert parent.poll() is None, log_tail(log)
            assert time.monotonic() < deadline, "the generator never answered\n" + log_tail(log)
            time.sleep(0.2)
        generator_pid = int(pid_file.read_text())
        assert _alive(generator_pid)
        parent.kill()
        parent.wait()
        assert _gone_within(generator_pid, 5.0), "the generator outlived its SIGKILLed parent by 5 s"
    finally:
        if parent.poll() is None:
            parent.kill()
        if generator_pid is not None and _alive(generator_pid):
            os.kill(generator_pid, signal.SIGKILL)


def stop_generator(process, inbox, outbox) -> None:
    """Whatever a test left running: kill the generator, release its queues without joining their feeders."""
    if process.exitcode is None:
        process.kill()
        process.join(5.0)
    for q in (inbox, outbox):
        q.cancel_join_thread()
        q.close()


def test_generator_exits_on_shutdown_while_its_big_rollout_is_unread(tmp_path, tiny_model_dir):
    # the pool stops reading the outbox before it sends Shutdown: the generator must not wait for a reader
    process, inbox, outbox = start_generator(tiny_model_dir, str(tmp_path))
    try:
        inbox.put(request(0, big=True))
        wait_until_rollout_is_sent(outbox)
        inbox.put(request(1, big=True))  # a second one, queued behind the first in the generator's feeder thread
        from async_rlhf.types import Shutdown

        inbox.put(Shutdown())
        process.join(10.0)
        assert process.exitcode == 0, f"exit code {process.exitcode} 10 s after Shutdown (None: still running)"
    finally:
        stop_generator(process, inbox, outbox)


def test_generator_ignores_sigint_and_sigterm_and_keeps_serving(tmp_path, tiny_model_dir):
    # Ctrl-C (and `kill -TERM -<group>`) reach every process of the group: the learner decides when its generators
    # stop (Shutdown), so a generator that took the signal as an error would be restarted during a graceful stop
    process, inbox, outbox = start_generator(tiny_model_dir, str(tmp_path))
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(process.pid, sig)
            process.join(2.5)  # idle in inbox.get, a generator that took SIGINT as an error was gone in 0.9 s
            assert process.is_alive(), f"{sig.name}: the generator exited with code {process.exitcode}"
        inbox.put(request(7, big=False))
        answer = outbox.get(timeout=60)
        assert answer.kind == "rollouts" and answer.batch_id == 7, answer
        assert process.is_alive()
    finally:
        stop_generator(process, inbox, outbox)


def _hold_forever(lock) -> None:  # a writer that took the outbox's write lock and is then SIGKILLed
    lock.acquire()
    time.sleep(600)


def test_a_generator_killed_holding_its_outbox_lock_is_replaced_by_one_that_delivers(tmp_path, tiny_model_dir):
    # SIGKILL can hit a generator while its feeder thread holds the outbox queue's write lock: nobody can write into
    # that queue again. With one outbox shared by all generators, the restarted generator (and every other one)
    # then never delivered; a restart must come with a queue of its own.
    import multiprocessing as mp
    import queue as queue_module

    from async_rlhf.generation.engine.worker import GeneratorSpec
    from async_rlhf.generation.pool.local import GeneratorPool

    spec = GeneratorSpec(generator_id=0, backend="transformers", model_path=tiny_model_dir, device="cpu", seed=0,
                         threads=1, log_path=str(tmp_path / "generator-0.log"))
    got: queue_module.Queue = queue_module.Queue()
    pool = GeneratorPool([spec], got.put, start_timeout=180, weight_sync_timeout=60, max_restarts=1)
    try:
        pool.start()
        holder = mp.get_context("spawn").Process(target=_hold_forever, args=(pool.outboxes[0]._wlock,), daemon=True)
        holder.start()
        deadline = time.monotonic() + 30
        while pool.outboxes[0]._wlock.acquire(block=False):  # until the holder has it
            pool.outboxes[0]._wlock.release()
            assert time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.05)
        holder.kill()
        holder.join()
        pool.processes[0].kill()
        pool.processes[0].join()
        pool.check()  # restarts generator 0
        assert pool.restarts[0] == 1
        pool.send_request(0, request(3, big=False))
        deadline = time.monotonic() + 120
        while got.empty():
            pool.check()
            assert time.monotonic() < deadline, "the restarted generator never delivered its rollout"
            time.sleep(0.2)
        assert got.get().batch_id == 3
    finally:
        pool.close()


@pytest.fixture(autouse=True)
def _no_leftover_children():
    yield
    for child in psutil.Process().children(recursive=True):
        if "generator_parent" in " ".join(child.cmdline()):
            child.kill()


def test_close_waits_for_every_live_generator_to_acknowledge_the_last_weights(tmp_path, tiny_model_dir):
    # The run's end closes the pool right after the last weight sync. A generator still sampling its last request
    # acknowledges those weights only after it: close must wait for that acknowledgement (bounded), or the run
    # summary's generator_versions says a generator never got the final weights (the flaky
    # test_two_generators_share_each_batch_and_track_every_version[1-vllm]: {0: 3, 1: 2}).
    import queue as queue_module

    from transformers import AutoModelForCausalLM

    from async_rlhf.generation.engine.worker import GeneratorSpec
    from async_rlhf.generation.pool.local import GeneratorPool
    from async_rlhf.types import GenerationRequest, SamplingSettings
    from async_rlhf.weight_sync.shm import ShmWeightTransport

    spec = GeneratorSpec(generator_id=0, backend="transformers", model_path=tiny_model_dir, device="cpu", seed=0,
                         threads=1, log_path=str(tmp_path / "generator-0.log"))
    got: queue_module.Queue = queue_module.Queue()
    pool = GeneratorPool([spec], got.put, start_timeout=180, weight_sync_timeout=60, max_restarts=0)
    transport = ShmWeightTransport(str(tmp_path))
    state = {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items()}
    try:
        pool.start()
        # a request that keeps the generator busy well past the reader's polling interval, then the last weights
        long = SamplingSettings(max_new_tokens=200, n=8, seed=0)
        pool.send_request(0, GenerationRequest(0, [0], [[5, 6, 7]], long))
        pool.send_weights(transport.publish(state, 1))
    finally:
        pool.close(timeout=120)
        transport.close()
    assert pool.acks.loaded_version == {0: 1}
    assert pool.acks.pending() == {}
