"""The Slurm backend: a sweep's unfinished cells as one job array, submitted through submitit, then watched.

    python launch/sweep.py --quick --output_dir outputs/sweep_quick --backend slurm --cpus_per_run 1

Guarantees:
- one array task per unfinished cell, every task with the same allocation (`Resources`: nodes, CPUs and GPUs per
  node, memory, time limit, partition, account, further sbatch options); the run directories, records, report,
  runs.jsonl and table are the local backend's (runs.py prepares each directory, cell_task.py runs the recipe with
  the same command, schedule.write_report and evals/ end both);
- nothing is submitted before every check passed, each naming the field and both numbers: the values themselves
  (`resources`), then the cluster (`check_cluster`: the partition exists, a node has the CPUs, memory and GPUs a cell
  asks for, the partition has enough nodes), then the scheduler itself on the exact batch script (`sbatch
  --test-only`), which also judges the grid's passed-through sbatch options;
- `render` is the batch script submitit submits (submitit's own renderer with the same parameters): --dry_run
  prints it;
- while the sweep waits, Ctrl-C or SIGTERM cancels the array (`scancel`): running cells get SIGTERM from Slurm
  and checkpoint, queued ones never start; the report says interrupted / not started and the sweep exits 130.
  A sweep killed outright (SIGKILL, a lost login session) leaves the array running: `--status DIR` shows it, and
  `scancel <array id>` (in the first line the sweep printed, and in every record) stops it;
- the time limit: each cell's allocation has the grid's `timeout_minutes`; `signal_delay_s` before it, the cell
  checkpoints and is requeued (cell_task.py), up to `MAX_TIME_LIMIT_REQUEUES` times; preemption requeues without
  counting. A requeued cell resumes from its checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from evals.run_result import run_finished
from launch.sweeping import ROOT, slurm_queue
from launch.sweeping.grid import Grid, GridError
from launch.sweeping.runs import Run, prepare_run_dir, read_record, split_finished, write_record
from launch.sweeping.schedule import write_report

MAX_TIME_LIMIT_REQUEUES = 3  # submitit's max_num_timeout: a cell that keeps hitting its time limit stops after this
DEFAULT_SIGNAL_DELAY_S = 120
SIGNAL_EARLY_S = 60  # sbatch(1), --signal: "the signal may be sent up to 60 seconds earlier than specified"


class SlurmError(GridError):
    """A resource or cluster check failed before anything was submitted; the message names the field."""


@dataclass(frozen=True)
class Resources:
    """One cell's allocation. gpus_per_run is the cell's total, split evenly over its nodes."""

    gpus_per_run: int = 0
    nodes_per_run: int = 1
    cpus_per_run: int = 1
    mem_gb: float | None = None
    time_minutes: float = 120.0
    partition: str | None = None
    account: str | None = None
    sbatch: dict = field(default_factory=dict)  # further sbatch options, passed through: {option: value}
    signal_delay_s: int = DEFAULT_SIGNAL_DELAY_S
    array_parallelism: int | None = None  # cells at a time (--jobs); None: as many as the scheduler runs

    @property
    def gpus_per_node(self) -> int:
        return self.gpus_per_run // self.nodes_per_run


def _int(name: str, value, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SlurmError(f"{name}: must be an integer >= {minimum}, got {value!r}")
    return value


def resources(grid: Grid, overrides: dict) -> Resources:
    """The grid's `gpus_per_run`, `timeout_minutes` and `slurm:` mapping, with the command line's non-None values
    over them; every value checked (SlurmError names the option and the grid key)."""
    spec = {**grid.slurm, "gpus_per_run": grid.gpus_per_run, "time_minutes": grid.timeout_minutes}
    spec.update({k: v for k, v in overrides.items() if v is not None and k != "sbatch"})
    sbatch = {**grid.slurm.get("sbatch", {}), **(overrides.get("sbatch") or {})}
    name = {k: f"--{k} (slurm.{k})" for k in spec}
    name["gpus_per_run"], name["time_minutes"] = "--gpus_per_run (gpus_per_run)", "--timeout_minutes (timeout_minutes)"
    res = Resources(
        gpus_per_run=_int(name["gpus_per_run"], spec.get("gpus_per_run", 0), 0),
        nodes_per_run=_int(name.get("nodes_per_run", ""), spec.get("nodes_per_run", 1), 1),
        cpus_per_run=_int(name.get("cpus_per_run", ""), spec.get("cpus_per_run", 1), 1),
        mem_gb=spec.get("mem_gb"),
        time_minutes=spec["time_minutes"],
        partition=spec.get("partition"),
        account=spec.get("account"),
        sbatch={str(k).lstrip("-"): v for k, v in sbatch.items()},
        signal_delay_s=_int(name.get("signal_delay_s", ""), spec.get("signal_delay_s", DEFAULT_SIGNAL_DELAY_S), 0),
        array_parallelism=overrides.get("jobs"),
    )
    if res.mem_gb is not None and (not isinstance(res.mem_gb, (int, float)) or res.mem_gb <= 0):
        raise SlurmError(f"--mem_gb (slurm.mem_gb): must be a number > 0, got {res.mem_gb!r}")
    if res.gpus_per_run % res.nodes_per_run:
        raise SlurmError(f"--gpus_per_run {res.gpus_per_run} is not divisible by --nodes_per_run "
                         f"{res.nodes_per_run}: a cell's GPUs are split evenly over its nodes")
    if res.nodes_per_run > 1 and grid.launcher != "accelerate":
        raise SlurmError(f"--nodes_per_run {res.nodes_per_run}: a cell of several nodes starts its ranks with "
                         f"accelerate launch; the grid's launcher is {grid.launcher!r}")
    if res.signal_delay_s + SIGNAL_EARLY_S >= res.time_minutes * 60:  # else the signal can come before the cell runs
        raise SlurmError(f"--signal_delay_s {res.signal_delay_s} + {SIGNAL_EARLY_S} s (Slurm may send the signal that "
                         f"much early) is not shorter than the time limit ({res.time_minutes:g} min = "
                         f"{res.time_minutes * 60:g} s)")
    owned = {"array", "output", "error", "signal", "open-mode", "job-name", "nodes", "ntasks-per-node",
             "cpus-per-task", "gpus-per-node", "mem", "time", "partition", "account"}
    taken = sorted(k for k in res.sbatch if k.replace("_", "-") in owned)
    if taken:
        raise SlurmError(f"slurm.sbatch / --sbatch: {', '.join(taken)} set by the sweep (use its own option: "
                         "--partition, --account, --cpus_per_run, --gpus_per_run, --nodes_per_run, --mem_gb, "
                         "--timeout_minutes)")
    return res


# ---- the batch script ----------------------------------------------------------------------------------------------
def executor_parameters(res: Resources, job_name: str) -> dict:
    """submitit.SlurmExecutor parameters (Slurm's own names) of a cell's allocation."""
    params = {
        "job_name": job_name,
        "time": max(1, math.ceil(res.time_minutes)),
        "nodes": res.nodes_per_run,
        "ntasks_per_node": 1,  # one cell task per node; it starts the launcher, which starts the ranks
        "cpus_per_task": res.cpus_per_run,
        "signal_delay_s": res.signal_delay_s,
        "stderr_to_stdout": True,
        # the recipe, `launch` and `evals` are found from the checkout, as on the machine that submitted
        "setup": [f"cd {shlex.quote(ROOT)}", f"export PYTHONPATH={shlex.quote(ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}"],
    }
    if res.gpus_per_run:
        params["gpus_per_node"] = res.gpus_per_node
    if res.mem_gb is not None:
        params["mem"] = f"{int(res.mem_gb)}GB" if res.mem_gb == int(res.mem_gb) else f"{int(res.mem_gb * 1024)}MB"
    if res.partition:
        params["partition"] = res.partition
    if res.account:
        params["account"] = res.account
    if res.sbatch:
        params["additional_parameters"] = {k.replace("_", "-"): v for k, v in res.sbatch.items()}
    if res.array_parallelism:
        params["array_parallelism"] = res.array_parallelism
    return params


def submitit_folder(output_dir: str) -> str:
    """submitit's folder: the pickled cell tasks and the array tasks' own logs (`%A_%a_0_log.out`)."""
    return os.path.join(output_dir, "slurm", "%j")


def render(res: Resources, output_dir: str, count: int, job_name: str) -> str:
    """The batch script submitit writes for an array of `count` cells (one task when count is 1)."""
    from submitit.slurm.slurm import _make_sbatch_string  # submitit's renderer: what it submits, byte for byte

    folder = submitit_folder(output_dir)
    command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit", shlex.quote(folder)])
    return _make_sbatch_string(command=command, folder=folder, map_count=count if count > 1 else None,
                               **executor_parameters(res, job_name))


def task_log(runs_dir: str, job_id: str) -> str:
    """submitit's log of an array task (or a one-cell job): what the task printed outside the recipe."""
    return os.path.join(os.path.dirname(runs_dir), "slurm", job_id, f"{job_id}_0_log.out")


def job_name(output_dir: str) -> str:
    return "sweep_" + re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.basename(os.path.normpath(output_dir)))


# ---- checks before anything is submitted --------------------------------------------------------------------------
def _gpus_of(gres: str) -> int:
    """GPUs of a node from sinfo's %G (`gpu:4`, `gpu:a100:8(S:0-1)`, `gpu:2,shard:4`, `(null)`)."""
    total = 0
    for part in gres.split(","):
        m = re.match(r"gpu(?::[A-Za-z0-9_.-]+)?:(\d+)", part.strip())
        if m:
            total += int(m.group(1))
    return total


def parse_sinfo(text: str) -> dict[str, dict]:
    """{partition: {"default", "cpus", "mem_mb", "gpus", "nodes"}} from `sinfo -h -o '%P|%c|%m|%G|%D'` (the largest
    node of each partition: a cell needs one node that has it all)."""
    parts: dict[str, dict] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, cpus, mem, gres, nodes = fields
        default = name.endswith("*")
        name = name.rstrip("*")
        p = parts.setdefault(name, {"default": default, "cpus": 0, "mem_mb": 0, "gpus": 0, "nodes": 0})
        p["cpus"] = max(p["cpus"], int(re.sub(r"\D", "", cpus) or 0))
        p["mem_mb"] = max(p["mem_mb"], int(re.sub(r"\D", "", mem) or 0))
        p["gpus"] = max(p["gpus"], _gpus_of(gres))
        p["nodes"] += int(re.sub(r"\D", "", nodes) or 0)
    return parts


def check_fits(res: Resources, partitions: dict[str, dict]) -> str:
    """The partition the cells go to; SlurmError when it does not exist or no node of it fits one cell."""
    if res.partition is None:
        default = [n for n, p in partitions.items() if p["default"]]
        if not default:
            raise SlurmError(f"--partition: the cluster has no default partition; give one of {', '.join(partitions)}")
        name = default[0]
    elif res.partition not in partitions:
        raise SlurmError(f"--partition {res.partition}: no such partition (the cluster has "
                         f"{', '.join(partitions) or 'none'})")
    else:
        name = res.partition
    p = partitions[name]
    if res.cpus_per_run > p["cpus"]:
        raise SlurmError(f"--cpus_per_run {res.cpus_per_run}: the nodes of partition {name} have {p['cpus']} CPUs")
    if res.gpus_per_node > p["gpus"]:
        raise SlurmError(f"--gpus_per_run {res.gpus_per_run} ({res.gpus_per_node} per node over {res.nodes_per_run} "
                         f"node(s)): the nodes of partition {name} have {p['gpus']} GPUs")
    if res.mem_gb is not None and res.mem_gb * 1024 > p["mem_mb"]:
        raise SlurmError(f"--mem_gb {res.mem_gb:g}: the nodes of partition {name} have {p['mem_mb'] / 1024:.0f} GB")
    if res.nodes_per_run > p["nodes"]:
        raise SlurmError(f"--nodes_per_run {res.nodes_per_run}: partition {name} has {p['nodes']} node(s)")
    return name


def slurm_here() -> bool:
    """sbatch and sinfo are on PATH (a login node, or `scripts/slurm_local.sh up` ran here)."""
    return bool(shutil.which("sbatch") and shutil.which("sinfo"))


def check_cluster(res: Resources, script: str) -> str:
    """Every check against the cluster, then `sbatch --test-only` of the batch script; returns the partition."""
    if not slurm_here():
        raise SlurmError("--backend slurm: sbatch / sinfo not found (run it on a Slurm login node; "
                         "`bash scripts/slurm_local.sh up` starts a one-node cluster on this machine)")
    out = subprocess.run(["sinfo", "-h", "-o", "%P|%c|%m|%G|%D"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise SlurmError(f"--backend slurm: sinfo failed: {out.stderr.strip()}")
    partition = check_fits(res, parse_sinfo(out.stdout))
    with tempfile.NamedTemporaryFile("w", suffix=".sh", delete=False) as f:
        f.write(script)
    try:
        test = subprocess.run(["sbatch", "--test-only", f.name], capture_output=True, text=True, timeout=60)
    finally:
        os.unlink(f.name)
    if test.returncode != 0:
        lines = [ln for ln in test.stderr.splitlines() if ln.strip() and "Try \"sbatch --help\"" not in ln]
        raise SlurmError("the scheduler rejected the batch script (sbatch --test-only): " + " / ".join(lines)
                         + ("; check the grid's slurm.sbatch options" if res.sbatch else ""))
    return partition


# ---- submit, watch, cancel ----------------------------------------------------------------------------------------
def submit(grid: Grid, runs: list[Run], output_dir: str, res: Resources, grace: float) -> dict[str, str]:
    """Prepare each run's directory (status queued) and submit them as one array; {run name: Slurm job id}."""
    import submitit

    from launch.sweeping.cell_task import CellTask

    runs_dir = os.path.join(output_dir, "runs")
    tasks = []
    for run in runs:
        run_dir, cmd, _ = prepare_run_dir(grid, run, runs_dir, status="queued", backend="slurm")
        tasks.append(CellTask(run.name, run_dir, cmd, run.expects_eval, grace, res.nodes_per_run))
    executor = submitit.SlurmExecutor(folder=submitit_folder(output_dir), max_num_timeout=MAX_TIME_LIMIT_REQUEUES)
    executor.update_parameters(**executor_parameters(res, job_name(output_dir)))
    jobs = executor.submit_array(tasks)
    ids = {run.name: str(job.job_id) for run, job in zip(runs, jobs)}
    for run in runs:
        run_dir = os.path.join(runs_dir, run.name)
        record = read_record(run_dir) or {}
        if record.get("status") == "queued":  # a fast task may already have written running
            record["job_id"] = ids[run.name]
            write_record(run_dir, record)
        else:
            write_record(run_dir, {**record, "job_id": ids[run.name]})
    with open(os.path.join(output_dir, "slurm", "jobs.json"), "w") as f:
        json.dump({"array": next(iter(ids.values())).split("_")[0], "jobs": ids}, f, indent=2)
    return ids


def cancel(ids: dict[str, str]) -> str:
    """scancel the array (every cell of it); returns the array id."""
    array = next(iter(ids.values())).split("_")[0]
    subprocess.run(["scancel", array], capture_output=True, timeout=60)
    return array


def _outcome(run: Run, record: dict | None, state: str, detail: str) -> dict:
    record = record or {}
    status = {"finished": "finished", "failed": "failed"}.get(state, state)
    return {"name": run.name, "status": status, "returncode": record.get("returncode"),
            "seconds": record.get("seconds"), "message": detail or record.get("message", ""),
            "job_id": record.get("job_id")}


def watch(runs: list[Run], ids: dict[str, str], runs_dir: str, poll_s: float = 5.0) -> dict[str, dict]:
    """Wait until every submitted cell is finished or failed, printing each change; {name: outcome}."""
    seen: dict[str, str] = {}
    done: dict[str, dict] = {}
    while len(done) < len(runs):
        entries = slurm_queue.query(list(ids.values()))
        for run in runs:
            if run.name in done:
                continue
            run_dir = os.path.join(runs_dir, run.name)
            record = read_record(run_dir)
            finished = run_finished(run_dir, run.expects_eval) and (record or {}).get("status") == "finished"
            entry = None if entries is None else entries.get(ids[run.name])
            state, detail = slurm_queue.cell_state(record, finished, entry)
            if entries is not None and entry is None and state not in ("finished", "failed"):
                state, detail = "failed", f"Slurm no longer knows job {ids[run.name]}, and the run did not finish"
            if state != seen.get(run.name):
                seen[run.name] = state
                if state == "failed" and (record or {}).get("status") in ("queued", "running", "requeued"):
                    # the task ended without writing why (killed before or around the recipe): submitit's log says
                    detail += f"; the task's own log: {task_log(runs_dir, ids[run.name])}"
                if state in ("finished", "failed"):
                    done[run.name] = _outcome(run, record, state, detail)
                    line = (f"[sweep] [{len(done)}/{len(runs)}] {state:<8} {run.name}  job {ids[run.name]}"
                            + (f"  {record.get('seconds') or 0:.0f}s" if record else ""))
                    if state == "failed":
                        line += (f"\n         {done[run.name]['message']}"
                                 f"\n         log: {os.path.join(run_dir, 'log.txt')}")
                    print(line, flush=True)
                else:
                    print(f"[sweep] {state:<8} {run.name}  job {ids[run.name]}" + (f"  {detail}" if detail else ""),
                          flush=True)
        if len(done) < len(runs):
            time.sleep(poll_s)
    return done


def run_slurm_sweep(grid: Grid, runs: list[Run], output_dir: str, res: Resources, grace: float = 30.0,
                    invocation: str = "", poll_s: float = 5.0) -> list[dict]:
    """The Slurm form of schedule.run_sweep: skip finished runs, submit the others as one array, watch it, write the
    report. Ctrl-C / SIGTERM (KeyboardInterrupt) cancels the array, writes the report and re-raises."""
    runs_dir = os.path.join(output_dir, "runs")
    os.makedirs(os.path.join(output_dir, "slurm"), exist_ok=True)
    outcomes, pending = split_finished(runs, runs_dir)
    print(f"[sweep] {len(runs)} runs: {len(runs) - len(pending)} already finished (skipped), {len(pending)} to "
          f"submit to Slurm", flush=True)
    if not pending:
        write_report(output_dir, grid, runs, outcomes, invocation)
        return [outcomes[r.name] for r in runs]
    ids = submit(grid, pending, output_dir, res, grace)
    array = next(iter(ids.values())).split("_")[0]
    print(f"[sweep] submitted {len(pending)} cell(s) as Slurm job {array} ({res.nodes_per_run} node(s), "
          f"{res.cpus_per_run} CPU(s), {res.gpus_per_run} GPU(s), {res.time_minutes:g} min each); logs in "
          f"{runs_dir}/<name>/log.txt; Ctrl-C cancels it (scancel {array}); `python launch/sweep.py --status "
          f"{output_dir}` shows it from another shell", flush=True)
    try:
        outcomes.update(watch(pending, ids, runs_dir, poll_s))
    except KeyboardInterrupt:
        cancel(ids)
        print(f"[sweep] interrupted: cancelled Slurm job {array} (scancel {array}): running cells get SIGTERM and "
              "checkpoint, queued ones never start; rerun the same command to continue", flush=True)
        for run in pending:
            if run.name not in outcomes:
                record = read_record(os.path.join(runs_dir, run.name)) or {}
                started = record.get("status") not in (None, "queued")
                outcomes[run.name] = {"name": run.name, "status": "interrupted" if started else "not started",
                                      "message": f"Slurm job {ids[run.name]} cancelled by Ctrl-C / SIGTERM of the "
                                                 "sweep", "job_id": ids[run.name]}
        write_report(output_dir, grid, runs, outcomes, invocation)
        raise
    write_report(output_dir, grid, runs, outcomes, invocation)
    return [outcomes[r.name] for r in runs]
