"""What Slurm says about a sweep's cells, read with `squeue`, and each cell's state from that and its run directory.

Guarantees:
- `parse_squeue` reads `squeue -h -t all -o '%i|%T|%r'` into {job id: (state, reason)}, one entry per array task:
  a pending range (`12_[3-5,7%2]`) is expanded; lines it does not understand are skipped, never guessed;
- `cell_state` is a pure function of (the run's record, whether its run directory is finished, the scheduler's entry
  or None): finished | running | queued | requeued | failed | not started, and a detail line. A finished run
  directory wins over anything the scheduler says; a job the scheduler no longer knows is judged by its record;
- `query` never raises: no squeue, or no controller, is None (the caller then reads the run directories alone).
Nothing here submits or cancels anything, and nothing imports submitit, so the local backend and --status use it
on a machine without Slurm.
"""

from __future__ import annotations

import re
import shutil
import subprocess

ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
          "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED"}
REQUEUEING = {"REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"}
SQUEUE_FORMAT = "%i|%T|%r"
_LINE = re.compile(r"^(?P<job>\d+)(?:_(?P<task>\d+|\[(?P<range>[^\]]+)\]))?\|(?P<state>[A-Z_]+)\|(?P<reason>.*)$")


def _expand(ranges: str) -> list[str]:
    """`3-5,7%2` -> ['3', '4', '5', '7'] (the `%` throttle is not a task)."""
    out = []
    for part in ranges.split("%")[0].split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out += [str(i) for i in range(int(lo), int(hi) + 1)]
        elif part:
            out.append(part)
    return out


def parse_squeue(text: str) -> dict[str, tuple[str, str]]:
    """{job id ('12' or '12_3'): (state, reason)} from squeue lines in SQUEUE_FORMAT."""
    entries = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        value = (m.group("state"), m.group("reason").strip())
        if m.group("range"):
            for task in _expand(m.group("range")):
                entries[f"{m.group('job')}_{task}"] = value
        elif m.group("task"):
            entries[f"{m.group('job')}_{m.group('task')}"] = value
        else:
            entries[m.group("job")] = value
    return entries


def query(job_ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """The scheduler's entries for these jobs (array tasks included), or None when squeue cannot answer."""
    arrays = sorted({j.split("_")[0] for j in job_ids if j})
    if not arrays or not shutil.which("squeue"):
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-o", SQUEUE_FORMAT, "-j", ",".join(arrays)],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        # squeue fails for a job id it has forgotten (past MinJobAge): the others are asked one by one
        if len(arrays) > 1:
            merged: dict[str, tuple[str, str]] = {}
            for a in arrays:
                merged.update(query([a]) or {})
            return merged
        return {} if "Invalid job id" in out.stderr else None
    return parse_squeue(out.stdout)


def active(job_id: str) -> str | None:
    """The scheduler's state of a job that is still queued or running, else None (also when squeue cannot answer)."""
    entry = (query([job_id]) or {}).get(job_id)
    return entry[0] if entry and entry[0] in ACTIVE else None


def cell_state(record: dict | None, finished: bool, entry: tuple[str, str] | None) -> tuple[str, str]:
    """(finished | running | queued | requeued | failed | not started, detail) of one cell."""
    if finished:
        return "finished", ""
    if record is None:
        return "not started", ""
    status, message = record.get("status"), record.get("message") or ""
    if entry is not None:
        state, reason = entry
        if state in RUNNING:
            attempt = record.get("attempt", 1) if status == "running" else 1  # else its task has not written yet
            return "running", f"attempt {attempt}" if attempt > 1 else ""
        if state in REQUEUEING or (state == "PENDING" and (status == "requeued" or record.get("attempt"))):
            return "requeued", message or f"Slurm {state} ({reason})"
        if state == "PENDING":
            return "queued", f"Slurm PENDING ({reason})" if reason and reason != "None" else ""
        # the job ended without finishing the run: its record says why, else the scheduler's state does
        return "failed", message if status in ("failed", "interrupted") and message else f"Slurm {state} ({reason})"
    if status in ("queued", "running", "requeued") and record.get("job_id"):
        return "failed", f"Slurm no longer knows job {record['job_id']}, and the run did not finish"
    if status == "running":  # a local run: its record says running only while its sweep runs it
        return "running", ""
    if status in ("failed", "timeout", "interrupted"):
        return "failed", f"{status}: {message}" if message else status
    return status or "not started", message
