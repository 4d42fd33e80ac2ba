"""Failures that end a run: a learner rank killed, generator restarts exhausted, a kill -9 in the middle of a
checkpoint save. Each must end in bounded time with no process left behind and a checkpoint the run can resume
from. The faults are real (SIGKILL, a generator whose weights are gone, a save stopped half-way), injected by
`fault_run.py` when the run is a subprocess."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file
from session_run import ROOT, own_port, start_logged, wait_for
from transformers import TrainerCallback

from async_rlhf import AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts
from async_rlhf.errors import CheckpointError, GeneratorFailed
from async_rlhf.learner.checkpointing import COMPLETE_MARKER, latest_complete_checkpoint, load_pipeline_state
from async_rlhf.pipeline.prompt_stream import PromptStream

FAULT_RUN = os.path.join(ROOT, "tests/integration/fault_run.py")
ENV = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def session_processes(sid: int) -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(" ".join(p.info["cmdline"] or [])[:200])
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return out


def trained_steps(out) -> int:
    path = os.path.join(out, "trained_batches.jsonl")
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


def check_records(out, steps: int, staleness: int = 1) -> None:
    """Every step 0..steps-1 trained the prompts the stream assigns it, within the staleness bound (the last
    record of a step wins: steps trained after the last checkpoint are trained again on resume)."""
    final = {}
    for line in open(os.path.join(out, "trained_batches.jsonl")):
        r = json.loads(line)
        final[r["step"]] = r
    assert sorted(final) == list(range(steps))
    stream = PromptStream(num_prompts=64, prompts_per_step=2, seed=5)  # fault_run.py's settings
    for step, r in final.items():
        assert r["prompt_ids"] == stream.prompts_for_step(step)
        assert step - r["policy_version"] <= staleness


# ---- a learner rank dies ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), 0])  # rank 0's death stays default
def test_killed_learner_rank_ends_the_run_cleanly(tmp_path, victim):
    """kill -9 one of two gloo learner ranks mid-run: the other rank's next collective fails, it shuts its
    generators down and exits, the launcher exits, nothing is left running and the last checkpoint is intact."""
    out, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    cmd = ["accelerate", "launch", "--config_file", os.path.join(ROOT, "launch/accelerate/cpu_2proc_gloo.yaml"),
           FAULT_RUN, str(out), "--max_steps", "400", "--save_steps", "3", "--shm_dir", str(shm)]
    log = tmp_path / "log.txt"
    proc = start_logged(cmd, log, env=ENV, own_session=True)
    try:
        wait_for(lambda: trained_steps(out) >= 8 and latest_complete_checkpoint(str(out)), 300, proc, log, "step 8")
        ranks = {}
        for child in psutil.Process(proc.pid).children(recursive=True):
            rank = child.environ().get("RANK")
            if rank is not None and "fault_run.py" in " ".join(child.cmdline()):
                ranks.setdefault(int(rank), child)  # the rank itself, not its generator (spawned: no script name)
        assert sorted(ranks) == [0, 1], ranks
        t0 = time.monotonic()
        ranks[victim].kill()
        proc.wait(timeout=120)
        ended = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert ended < 90, f"the run took {ended:.0f}s to end after a learner rank died"
    deadline = time.monotonic() + 10  # generators orphaned by a killed rank 0 notice within a second or two
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not session_processes(proc.pid), session_processes(proc.pid)
    if victim == 1:  # rank 0 survived the kill, so it closed its pipeline: generators stopped, weights removed
        assert not os.listdir(shm), os.listdir(shm)
    last = latest_complete_checkpoint(str(out))
    assert last is not None
    state = json.load(open(os.path.join(last, "async_rlhf_pipeline.json")))
    load_pipeline_state(last, state["identity"])  # complete, readable, consistent
    assert load_file(os.path.join(last, "model.safetensors"))
    torch.load(os.path.join(last, "optimizer.pt"), weights_only=True)


# ---- generator restarts exhausted -----------------------------------------------------------------------------------
class _BreakGenerator(TrainerCallback):
    """After optimizer step `step`: delete the generators' weights and kill generator 0, so that every restart
    fails to load its model and reports why."""

    def __init__(self, trainer, model_dir, step):
        self.trainer, self.model_dir, self.step = trainer, model_dir, step
        self.t = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.unlink(os.path.join(self.model_dir, "model.safetensors"))
            os.kill(self.trainer.pipeline.pool.processes[0].pid, signal.SIGKILL)
            self.t = time.monotonic()


def test_exhausted_generator_restarts_save_a_checkpoint_and_name_the_generator(tmp_path, tiny_model_dir,
                                                                               tiny_run_config):
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, model_dir)  # generators start from here; the test breaks it
    out = tmp_path / "run"
    config = functools.partial(tiny_run_config, out, max_steps=50, max_staleness=1, generator_max_restarts=1, seed=5)
    trainer = AsyncOnlineDPOTrainer(model_dir, reward_funcs=lowercase_reward, args=config(),
                                    train_dataset=toy_prompts(64, seed=5))
    breaker = _BreakGenerator(trainer, model_dir, step=3)
    trainer.add_callback(breaker)
    with pytest.raises(GeneratorFailed) as info:
        trainer.train()
    took = time.monotonic() - breaker.t
    message = str(info.value)
    step = trainer.state.global_step
    assert "generator 0 (cpu)" in message and "restarts exhausted (1)" in message, message
    assert "Last error:" in message and "model.safetensors" in message, message  # the load error, from the generator
    assert f"Saved {out / f'checkpoint-{step}'} at step {step}" in message, message
    assert took < 60, f"{took:.0f}s from the failure to the end of the run"
    assert not [p for p in psutil.Process().children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]

    # the checkpoint is complete and resumes once the cause is fixed
    assert step >= 3 and latest_complete_checkpoint(str(out)) == str(out / f"checkpoint-{step}")
    shutil.copy(os.path.join(tiny_model_dir, "model.safetensors"), model_dir)
    resumed = AsyncOnlineDPOTrainer(model_dir, reward_funcs=lowercase_reward, args=config(max_steps=step + 2),
                                    train_dataset=toy_prompts(64, seed=5))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.run_summary["steps"] == step + 2
    check_records(out, step + 2)


@pytest.mark.slow
def test_exhausted_restarts_with_two_learner_ranks_checkpoint_on_both(tmp_path):
    """Rank 0 owns the generators; the failure reaches rank 1 through the step's broadcast, and both ranks save
    the checkpoint together (DDP's RNG files come from every rank)."""
    out = tmp_path / "run"
    cmd = ["accelerate", "launch", "--config_file", os.path.join(ROOT, "launch/accelerate/cpu_2proc_gloo.yaml"),
           FAULT_RUN, str(out), "--max_steps", "50", "--save_steps", "100", "--fault", "break_generator", "--at", "4"]
    proc = subprocess.run(own_port(cmd), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "GeneratorFailed: generator 0 (cpu)" in log and "restarts exhausted (1)" in log, log[-4000:]
    assert "[rank1]" in log and log.count("restarts exhausted") >= 2, log[-4000:]  # rank 1 raised it too
    saved = re.search(r"Saved (\S+) at step (\d+)", log)
    assert saved and int(saved.group(2)) >= 4, log[-4000:]  # the step that waited in vain (4, or 5 if 4 was queued)
    checkpoint = saved.group(1)
    assert latest_complete_checkpoint(str(out)) == checkpoint
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "optimizer.pt"} <= set(os.listdir(checkpoint))


# ---- kill -9 during a checkpoint save ------------------------------------------------------------------------------
@pytest.mark.slow  # ~50 s a case; the default tier keeps the marker's own test (unit/learner/test_checkpoint_markers.py)
@pytest.mark.parametrize("where", ["hang_in_save", "hang_mid_save"])
def test_kill_minus_9_during_a_save_keeps_the_previous_checkpoint_resumable(tmp_path, where):
    out, shm = tmp_path / "run", tmp_path / "shm"  # a killed run cannot remove its weight files: keep them here
    shm.mkdir()
    steps = 10
    run = [sys.executable, FAULT_RUN, str(out), "--max_steps", str(steps), "--save_steps", "3", "--shm_dir", str(shm)]
    log = tmp_path / "log.txt"
    proc = start_logged(run + ["--fault", where, "--at", "6"], log, env=ENV, own_session=True)
    try:
        wait_for(lambda: (out / "hanging_in_save").exists(), 240, proc, log, "the save of checkpoint-6")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole run, mid-save
        proc.wait(30)
    half = out / "checkpoint-6"
    assert half.is_dir() and not (half / COMPLETE_MARKER).exists()
    assert latest_complete_checkpoint(str(out)) == str(out / "checkpoint-3")
    with pytest.raises(CheckpointError, match="incomplete"):
        load_pipeline_state(str(half), {})

    resumed = subprocess.run(run + ["--resume"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    summary = json.load(open(out / "run_summary.json"))
    assert summary["steps"] == steps
    assert (half / COMPLETE_MARKER).exists()  # saved again, whole this time
    check_records(out, steps)
