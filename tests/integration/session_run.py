"""Running a whole training launch from a test: in its own session, so that every process it starts (learner
ranks, generators) can be found afterwards by session id, even if orphaned."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_port(cmd: list[str]) -> list[str]:
    """`cmd` with `--main_process_port <free port>` after `accelerate launch` where it names none: learner ranks of
    two runs at once (two test sessions on one machine) would otherwise meet on accelerate's default port 29500."""
    if cmd[:2] != ["accelerate", "launch"] or "--main_process_port" in cmd:
        return cmd
    return [*cmd[:2], "--main_process_port", str(free_port()), *cmd[2:]]


def start_logged(cmd: list[str], log_path, env: dict | None = None, own_session: bool = False) -> subprocess.Popen:
    """Start `cmd` from the repository root with stdout and stderr into the file log_path. Not into a pipe: a pipe
    the test does not drain fills at 64 KiB of step logs and blocks the child inside print(), where not even its
    signal handlers run, so the test would hang on the pipe instead of testing the run."""
    with open(log_path, "w") as log:  # the child holds its own descriptor
        return subprocess.Popen(own_port(cmd), cwd=ROOT, env=env or {**os.environ, "WANDB_MODE": "disabled"}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=own_session)


def log_tail(log_path, chars: int = 4000) -> str:
    with open(log_path, errors="replace") as f:
        return f.read()[-chars:]


def wait_for(condition, timeout: float, proc: subprocess.Popen, log, what: str) -> None:
    """Poll `condition()` until it holds; fail with the log's tail if the run ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n{log_tail(log)}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log_tail(log)}"
        time.sleep(0.2)


def run_in_own_session(cmd: list[str], timeout: float, log_tail: int = 6000) -> str:
    """Run `cmd` from the repository root with WANDB off; return its output. Fails with the log's tail on a
    non-zero exit, on timeout (the whole session is killed), and when a process of the session outlives it."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(own_port(cmd), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        log, _ = proc.communicate()
        raise AssertionError(f"run did not finish in {timeout:.0f} s:\n" + log[-log_tail:])
    assert proc.returncode == 0, log[-log_tail:]
    # Children may still be exiting when the launcher returns (a vLLM engine core freeing its memory): give them a
    # few seconds; a process that is really left behind is still there after them. Zombies are already dead.
    deadline = time.monotonic() + 15
    while True:
        leftovers = _session_processes(proc.pid)
        if not leftovers or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not leftovers, f"processes left alive after the run: {leftovers}"
    return log


def _session_processes(session_id: int) -> list[dict]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if os.getsid(p.pid) == session_id and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p.info)
        except (ProcessLookupError, PermissionError):
            pass
    return found


def stop_group(proc: subprocess.Popen, seconds: float = 60) -> bool:
    """SIGTERM the process group `proc` leads (started with `start_new_session`), wait up to `seconds`, then SIGKILL
    it. True if it stopped on SIGTERM (or had already exited)."""
    if proc.poll() is not None:
        return True
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False
