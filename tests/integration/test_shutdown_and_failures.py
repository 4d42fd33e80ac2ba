"""The run never hangs and never leaves a generator behind: on errors, on SIGTERM, on a generator that fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from run_records import check_staleness_records
from session_run import ROOT, log_tail, start_logged, wait_for
from transformers import TrainerCallback

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.errors import GeneratorFailed, RewardError, StageTimeout
from async_rlhf.learner.checkpointing import latest_complete_checkpoint


def generator_processes() -> list[psutil.Process]:
    """Spawned generator processes (not the resource tracker, which lives as long as the test process)."""
    return [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]


def failing_reward(prompts, completions, **kw):
    return [float("nan")] * len(completions)


def test_reward_error_stops_the_run_and_the_generators(tmp_path, tiny_model_dir, tiny_run_config):
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=failing_reward, args=tiny_run_config(tmp_path),
                                    train_dataset=toy_prompts(16))
    with pytest.raises(RewardError, match="'failing_reward' returned nan for prompt id"):
        trainer.train()
    deadline = time.monotonic() + 10
    while generator_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not generator_processes()


def test_generator_that_cannot_start_is_reported_with_its_error(tmp_path, tiny_model_dir, tiny_run_config):
    # a model directory without weights: the generator's engine fails to load it
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(tiny_model_dir, "config.json")).read())
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=failing_reward, args=tiny_run_config(tmp_path),
                                    train_dataset=toy_prompts(16))
    trainer._source_model_path = str(broken)  # the generators start from this directory
    t0 = time.monotonic()
    with pytest.raises(GeneratorFailed, match="generator 0 failed to start"):
        trainer.train()
    # a failed run waits for no acknowledgement and gives the stopped generator 2 s (before: 20 s + 20 s, 53 s in all)
    assert time.monotonic() - t0 < 40
    assert not generator_processes()


@pytest.mark.slow  # the same handler as Ctrl-C below (trainers/base.py), which stays in the default tier
def test_sigterm_mid_run_exits_promptly_and_leaves_no_process(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes/online_dpo.py"), "--task", "toy", "--output_dir", str(out),
           "--max_steps", "100000", "--generator_backend", "transformers", "--per_device_train_batch_size", "2",
           "--max_new_tokens", "6", "--max_length", "48", "--disable_tqdm", "true"]
    log = tmp_path / "log.txt"
    proc = _signal_a_running_run(cmd, out, log, "SIGTERM", group=False)
    assert proc.returncode != 0


def test_ctrl_c_to_the_process_group_checkpoints_restarts_nothing_and_leaves_no_process(tmp_path):
    # Ctrl-C in a terminal: SIGINT to every process of the foreground group, generators included. They ignore it;
    # the trainer finishes the step, checkpoints and stops them (no restart on the way out). Long completions keep
    # the learner waiting for rollouts most of the time, where a generator that died of the signal was restarted.
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes/online_dpo.py"), "--task", "toy", "--output_dir", str(out),
           "--max_steps", "100000", "--generator_backend", "transformers", "--per_device_train_batch_size", "2",
           "--max_new_tokens", "150", "--max_length", "200", "--max_staleness", "0", "--disable_tqdm", "true"]
    log = tmp_path / "log.txt"
    _signal_a_running_run(cmd, out, log, "Ctrl-C", group=True)
    text = log_tail(log, 100_000)
    assert "stopped by signal 2 after saving checkpoint-" in text, text[-4000:]
    assert "restarting" not in text and "KeyboardInterrupt: \n" not in text, text[-4000:]
    assert latest_complete_checkpoint(str(out)) is not None


class _Inject(TrainerCallback):
    """Does something to generator 0's process after a given optimizer step (a real failure, not a mock)."""

    def __init__(self, trainer, step, sig):
        self.trainer, self.step, self.sig = trainer, step, sig

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(self.trainer.pipeline.pool.processes[0].pid, self.sig)


def test_killed_generator_is_restarted_and_no_batch_is_lost(tmp_path, tiny_model_dir, tiny_run_config):
    args = tiny_run_config(tmp_path, max_steps=6, max_staleness=1)
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=args,
                                    train_dataset=toy_prompts(32))
    trainer.add_callback(_Inject(trainer, 2, signal.SIGKILL))
    trainer.train()
    s = trainer.run_summary
    assert s["generator_restarts"] == 1
    check_staleness_records(tmp_path, 6, 1, s, dropped=None)  # every step trained once, within the bound
    assert s["generator_versions"][0] >= 5  # the restarted generator caught up with the newest weights
    assert not generator_processes()


def test_stalled_generator_fails_within_the_rollout_timeout(tmp_path, tiny_model_dir, tiny_run_config):
    args = tiny_run_config(tmp_path, max_steps=50, max_staleness=0, rollout_timeout=8, weight_sync_timeout=600)
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=args,
                                    train_dataset=toy_prompts(32))
    trainer.add_callback(_Inject(trainer, 1, signal.SIGSTOP))
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match="rollout queue: batch 1 did not arrive"):
        trainer.train()
    # a failed run waits for no acknowledgement and gives the stopped generator 2 s (before: 20 s + 20 s, 53 s in all)
    assert time.monotonic() - t0 < 40
    assert not generator_processes()


@pytest.mark.slow  # suite time: the acknowledgement timeout's own test stays (unit/pipeline/test_boundaries.py)
def test_stalled_weight_transfer_fails_within_the_sync_timeout(tmp_path, tiny_model_dir, tiny_run_config):
    args = tiny_run_config(tmp_path, max_steps=50, max_staleness=0, rollout_timeout=600, weight_sync_timeout=5)
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=args,
                                    train_dataset=toy_prompts(32))
    trainer.add_callback(_Inject(trainer, 1, signal.SIGSTOP))
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match="weight sync: generator 0 did not acknowledge weights v1 within 5s"):
        trainer.train()
    # a failed run waits for no acknowledgement and gives the stopped generator 2 s (before: 20 s + 20 s, 53 s in all)
    assert time.monotonic() - t0 < 40
    assert not generator_processes()


def test_a_policy_without_a_directory_leaves_nothing_in_shm_dir(tmp_path, tiny_model_dir, tiny_run_config):
    # an in-memory policy: rank 0 writes the generators' initial copy (async_rlhf-init-*) next to the weight files;
    # both are locked while the run lives (a clean-up by another run leaves them) and removed when train() ends
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_rlhf.weight_sync.shm_dirs import remove_orphaned_dirs

    shm = tmp_path / "shm"
    shm.mkdir()
    seen = []

    class _Look(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append((sorted(os.listdir(shm)), remove_orphaned_dirs(str(shm))))

    args = tiny_run_config(tmp_path / "out", max_steps=2, shm_dir=str(shm))
    trainer = AsyncOnlineDPOTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=lowercase_reward,
                                    args=args, train_dataset=toy_prompts(16),
                                    processing_class=AutoTokenizer.from_pretrained(tiny_model_dir))
    trainer.add_callback(_Look())
    trainer.train()
    names, removed = seen[0]
    assert [n.split("-")[1] for n in names] == ["init", "weights"] and removed == [], seen
    assert os.listdir(shm) == []


def _signal_a_running_run(cmd: list[str], out, log, what: str, group: bool) -> subprocess.Popen:
    """Start `cmd`, wait for its first logged step, send SIGTERM to it (or, with `group`, SIGINT to its whole process
    group, as Ctrl-C does); assert it exits within 60 s and leaves none of its processes alive. Returns it."""
    proc = start_logged(cmd, log, own_session=group)
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists(), 180, proc, log, "the first logged step")
        family = psutil.Process(proc.pid).children(recursive=True)
        assert family, "expected a generator process"
        if group:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not exit within 60 s of {what}\n" + log_tail(log))
    finally:
        if proc.poll() is None:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    time.sleep(1.0)
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left alive: {[p.cmdline() for p in alive]}"
    return proc
