"""One cell inside its Slurm allocation: what an array task runs (submitit unpickles a `CellTask` and calls it).

Guarantees:
- the recipe runs as the local backend runs it: the same command on the cell's config.yaml, in its own process group
  (process.py), stdout and stderr appended to the run's log.txt (an attempt after a requeue appends, under a header
  line); sweep_run.json goes running (host, job id, attempt) -> finished | failed (exit code, the log's error line,
  seconds) | requeued | interrupted, replaced atomically;
- the time-limit or preemption signal submitit asks Slurm for (SIGUSR2, `--signal=USR2@signal_delay_s`) is acted
  on here only: the recipe's processes are started with SIGUSR2 ignored. `checkpoint` sends the recipe's group one
  SIGTERM (the recipe finishes its step, saves checkpoint-<step> and exits), SIGKILL after `grace` seconds, marks
  the record requeued and hands this task back to submitit, which requeues the array task (`scontrol requeue`);
- a task that starts in a run directory holding a complete checkpoint resumes from it (`--resume_from_checkpoint
  last`): the sweep empties every unfinished run directory before it submits, so such a checkpoint is always an
  earlier attempt of this same submission, and the requeued cell continues where it stopped;
- SIGTERM from the scheduler (scancel, preemption with PreemptMode=REQUEUE) reaches the recipe directly, once,
  through the step's process tracking; it is not forwarded again (a second SIGTERM would make the recipe stop
  without its checkpoint). The record says interrupted; a requeued task then resumes as above;
- a cell of several nodes: submitit starts one task per node, each starts the launcher with its machine rank and
  the first node as the main process; only the task of rank 0 writes the record.
A failed recipe raises `CellFailed` (the array task ends FAILED in Slurm, its record says why).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import submitit

from async_rlhf.learner.checkpointing import latest_complete_checkpoint
from evals.run_result import run_finished
from launch.sweeping import process
from launch.sweeping.runs import read_record, write_record

MAIN_PORT = 29500  # accelerate's rendezvous port for a cell of several nodes


class CellFailed(RuntimeError):
    """The cell's recipe exited without finishing; the message is its error line."""


def node_command(cmd: list[str], nodes: int, rank: int, head: str) -> list[str]:
    """The launcher command of machine `rank` of a cell of `nodes` nodes whose first node is `head`: accelerate's
    multi-machine flags inserted after `accelerate.commands.launch`. One node: the command unchanged."""
    if nodes <= 1:
        return list(cmd)
    at = cmd.index("accelerate.commands.launch") + 1  # the grid check refuses launcher: python with several nodes
    return cmd[:at] + ["--num_machines", str(nodes), "--machine_rank", str(rank), "--main_process_ip", head,
                       "--main_process_port", str(MAIN_PORT)] + cmd[at:]


def _ignore_usr2() -> None:  # in the child, before exec: inherited by the launcher, the recipe and its generators
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class CellTask(submitit.helpers.Checkpointable):
    """Run one cell's recipe in its allocation; `checkpoint` is called by submitit on the time-limit signal."""

    def __init__(self, name: str, run_dir: str, cmd: list[str], expects_eval: bool, grace: float, nodes: int = 1):
        self.name, self.run_dir, self.cmd = name, run_dir, list(cmd)
        self.expects_eval, self.grace, self.nodes = expects_eval, grace, nodes
        self._proc: subprocess.Popen | None = None
        self._started = 0.0
        self._terminated = False  # SIGTERM came from the scheduler

    def __getstate__(self) -> dict:  # what is pickled for the requeue: the cell, not this attempt's process
        return {k: v for k, v in self.__dict__.items() if k in ("name", "run_dir", "cmd", "expects_eval", "grace",
                                                                 "nodes")}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    # ---- the attempt ----------------------------------------------------------------------------------------------
    def _update(self, **fields) -> None:
        if self._rank() == 0:
            record = read_record(self.run_dir) or {}
            record.update(fields)
            write_record(self.run_dir, record)

    def _rank(self) -> int:
        return int(os.environ.get("SLURM_PROCID", "0"))

    def __call__(self) -> str:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("WANDB_MODE", "offline")
        if "OMP_NUM_THREADS" not in env and os.environ.get("SLURM_CPUS_PER_TASK"):
            env["OMP_NUM_THREADS"] = os.environ["SLURM_CPUS_PER_TASK"]
        cmd = node_command(self.cmd, self.nodes, int(os.environ.get("SLURM_NODEID", "0")), _head_node())
        resumed = latest_complete_checkpoint(self.run_dir)  # the rule the recipe's `last` uses
        if resumed:
            cmd = cmd + ["--resume_from_checkpoint", "last"]
        job = submitit.JobEnvironment().job_id
        attempt = int(os.environ.get("SLURM_RESTART_COUNT", "0")) + 1
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        log_path = os.path.join(self.run_dir, "log.txt" if self._rank() == 0 else f"log.node{self._rank()}.txt")
        with open(log_path, "a") as log:
            log.write(f"\n=== attempt {attempt}, Slurm job {job} on {socket.gethostname()}"
                      + (f", resuming from {os.path.basename(resumed)}" if resumed else "") + " ===\n$ "
                      + " ".join(cmd) + "\n")
            log.flush()
            self._started = time.monotonic()
            self._update(status="running", job_id=job, host=socket.gethostname(), attempt=attempt,
                         resumed_from=os.path.basename(resumed) if resumed else None, message="")
            self._proc = subprocess.Popen(cmd, cwd=process.ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                          preexec_fn=_ignore_usr2)
            # poll, not wait(): the signal handler (checkpoint) must be able to wait on the process itself
            while self._proc.poll() is None:
                time.sleep(0.5)
            self._wait_for_group()  # Slurm's SIGTERM reaches every process: the launcher dies at once, the recipe
            # finishes its step and saves
        signal.signal(signal.SIGTERM, previous)
        return self._conclude()

    def _wait_for_group(self) -> None:
        deadline = time.monotonic() + self.grace
        while process.group_alive(self._proc) and time.monotonic() < deadline:
            time.sleep(0.2)

    def _on_sigterm(self, signum, frame) -> None:
        self._terminated = True  # the recipe got its own SIGTERM from the step; a second one would skip its save

    def _conclude(self) -> str:
        rc = self._proc.returncode
        seconds = round(time.monotonic() - self._started, 1)
        if rc == 0 and run_finished(self.run_dir, self.expects_eval):
            self._update(status="finished", returncode=0, seconds=seconds, message="")
            return "finished"
        log = os.path.join(self.run_dir, "log.txt")
        if self._terminated:
            self._update(status="interrupted", returncode=rc, seconds=seconds,
                         message="stopped by SIGTERM from Slurm (scancel or preemption); a requeued task resumes "
                                 "from its last checkpoint")
            return "interrupted"
        message = process.error_line(log) if rc != 0 else (
            "exited 0 but did not write run_summary.json" + (" / eval_results.json" if self.expects_eval else ""))
        self._update(status="failed", returncode=rc, seconds=seconds, message=message)
        raise CellFailed(f"{self.name}: {message} (log: {log})")

    # ---- submitit's time-limit / preemption hook ------------------------------------------------------------------
    def checkpoint(self, *args, **kwargs):
        """SIGUSR2: stop the recipe with one SIGTERM (it saves a checkpoint), then hand the cell back for a requeue.
        A recipe that already finished is not requeued (None: submitit then ends the task)."""
        proc = self._proc
        if proc is not None and process.group_alive(proc):
            if self._terminated:  # the scheduler's SIGTERM already asked it to save: a second one would skip that
                self._wait_for_group()
            process.stop([proc], self.grace)  # SIGTERM, SIGKILL after grace (at once when the group is gone)
        if proc is not None and proc.returncode == 0 and run_finished(self.run_dir, self.expects_eval):
            self._update(status="finished", returncode=0, seconds=round(time.monotonic() - self._started, 1))
            return None
        saved = latest_complete_checkpoint(self.run_dir)
        self._update(status="requeued", returncode=None if proc is None else proc.returncode,
                     seconds=round(time.monotonic() - self._started, 1),
                     message="time limit or preemption: " + (f"saved {os.path.basename(saved)}, requeued to resume"
                                                             if saved else "no checkpoint yet, requeued to restart"))
        return super().checkpoint(*args, **kwargs)


def _head_node() -> str:
    """The first node of this allocation (Slurm expands its node list), or this host outside Slurm."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return socket.gethostname()
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return nodelist.split(",")[0]
