"""One run as an operating-system process: started in its own session (so its process group holds the launcher,
the recipe and every generator process they start), stopped as a group, and explained by its log's error line.

Guarantees: `stop` sends SIGTERM to each group (the recipe checkpoints and stops), waits up to `grace` seconds for
every process of the groups to end (not only the launcher that leads it, which may die at once while its recipe
still saves), then SIGKILLs the groups, whatever is left of them; a KeyboardInterrupt while waiting skips to SIGKILL. Signals to
a group that is already gone are ignored. Nothing here knows about grids or runs.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from launch.sweeping import ROOT


def start(cmd: list[str], log, env: dict) -> subprocess.Popen:
    """Start cmd in the checkout with stdout and stderr to the open file `log`, in a new session: its pgid is its
    pid, and a signal to the group reaches every process it starts."""
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM each process group (the recipe checkpoints and stops), then SIGKILL what is left after `grace`.
    A KeyboardInterrupt while waiting kills at once."""
    for p in procs:
        signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:  # the whole group, not its leader: `accelerate launch` dies on SIGTERM at once while its recipe saves
        while any(group_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("[sweep] second interrupt: killing now", flush=True)
    for p in procs:
        signal_group(p, signal.SIGKILL)  # also reaps generator processes that outlived their parent
        try:  # bounded: called from a signal handler (cell_task.py), a wait() could block on the interrupted poll
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def group_alive(proc: subprocess.Popen) -> bool:
    """Whether a process of proc's group is still running (zombies aside); the leader is reaped first."""
    proc.poll()
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == proc.pid and fields[0] != "Z":  # fields after the name: state, ppid, pgrp
                    return True
        return False
    except OSError:  # no /proc: the leader alone
        return proc.poll() is None


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child leads its own session, so pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


# an exception line, or argparse's `<script>.py: error: ...`
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Failed|Timeout|Interrupt)\w*: |^[\w.-]+\.py: error: ")


def error_line(log_path: str) -> str:
    """The last exception line of a log (not accelerate's wrapper error), or argparse's `<script>.py: error: ...`
    line, else its last non-empty line."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if _ERROR_LINE.match(ln) and not ln.startswith("subprocess.CalledProcessError")]
    return (errors or lines or ["(empty log)"])[-1][:500]


def still_running(run_dir: str, record: dict) -> int | None:
    """The process group of an earlier sweep's run that is still alive (that sweep was killed), else None."""
    pgid = record.get("pgid") if record.get("status") == "running" else None
    if not pgid:
        return None
    try:
        with open(f"/proc/{pgid}/cmdline", "rb") as f:  # the group leader is the launcher we started
            alive = run_dir.encode() in f.read()
    except OSError:
        return None
    return pgid if alive else None

