"""Running a sweep: every unfinished run, `grid.jobs` at a time, each under its timeout; then the report.

Guarantees:
- a run starts in an emptied `DIR/runs/<name>/` holding its `config.yaml` (its flags and output_dir), `log.txt` and
  `sweep_run.json` (cell, command, status, exit code, seconds); finished runs are skipped, not restarted;
- a run that fails or outlives its timeout is stopped with its process group (process.py) and reported with its
  error line; the others still run;
- with GPU slots (gpus.py: `jobs` disjoint sets of `gpus_per_run` GPUs), each running run holds one slot as its
  `CUDA_VISIBLE_DEVICES` (recorded in sweep_run.json) and gives it back when it ends: no two running runs share a
  GPU. Without slots, runs inherit the sweep's environment;
- Ctrl-C or SIGTERM (raised as KeyboardInterrupt by the caller's handler) stops every running run the same way,
  marks the queued ones "not started", writes the report and re-raises;
- whether it ends or is interrupted, the sweep leaves `DIR/sweep_report.json` (the command, every run's status)
  and `DIR/runs.jsonl` (every run's records in one file, evals/archive.py: what results are committed as).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass

from evals.archive import write_archive
from evals.run_result import run_finished
from launch.sweeping import process
from launch.sweeping.estimate import duration, estimate
from launch.sweeping.gpus import GpuPool
from launch.sweeping.grid import Grid
from launch.sweeping.runs import Run, prepare_run_dir, split_finished, write_record


@dataclass
class Active:
    """A run whose process is going: what the loop polls, and what `_finish` records."""

    run: Run
    run_dir: str
    proc: subprocess.Popen
    log: object
    started: float
    deadline: float
    record: dict
    gpu_slot: str | None = None  # its CUDA_VISIBLE_DEVICES when the sweep packs GPUs


def _start(grid: Grid, run: Run, runs_dir: str, timeout_s: float, env: dict, gpu_slot: str | None = None) -> Active:
    extra = {} if gpu_slot is None else {"cuda_visible_devices": gpu_slot}
    run_dir, cmd, record = prepare_run_dir(grid, run, runs_dir, status="running", **extra)
    if gpu_slot is not None:
        env = {**env, "CUDA_VISIBLE_DEVICES": gpu_slot}
    log = open(os.path.join(run_dir, "log.txt"), "w")
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    try:
        proc = process.start(cmd, log, env)
    except OSError:
        log.close()
        raise
    record["pgid"] = proc.pid  # its own session: pgid == pid
    write_record(run_dir, record)
    now = time.monotonic()
    return Active(run, run_dir, proc, log, now, now + timeout_s, record, gpu_slot)


def _finish(a: Active, status: str, message: str = "") -> dict:
    a.log.close()
    seconds = time.monotonic() - a.started
    rc = a.proc.returncode
    if status == "exited":
        if rc == 0 and run_finished(a.run_dir, a.run.expects_eval):
            status = "finished"
        else:
            status = "failed"
            message = process.error_line(os.path.join(a.run_dir, "log.txt")) if rc != 0 else (
                "exited 0 but did not write run_summary.json" + (" / eval_results.json" if a.run.expects_eval else ""))
    a.record.update(status=status, returncode=rc, seconds=round(seconds, 1), message=message)
    write_record(a.run_dir, a.record)
    return a.record


def run_sweep(grid: Grid, runs: list[Run], output_dir: str, grace: float = 30.0, invocation: str = "",
              gpu_slots: list[str] | None = None) -> list[dict]:
    """Run every unfinished run, `grid.jobs` at a time (each on its own slot of `gpu_slots` when given, which then
    has `grid.jobs` entries). Returns one outcome per run (finished runs as 'skipped')."""
    jobs, timeout_s = grid.jobs, 60.0 * grid.timeout_minutes
    runs_dir = os.path.join(output_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    outcomes, pending = split_finished(runs, runs_dir)
    seconds, _ = estimate(grid, runs, runs_dir)
    print(f"[sweep] {len(runs)} runs: {len(runs) - len(pending)} already finished (skipped), {len(pending)} to run, "
          f"{jobs} at a time, timeout {timeout_s / 60:g} min each"
          + (f"; estimate ~{duration(seconds)}" if seconds and pending else ""), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("WANDB_MODE", "offline")
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # concurrent runs share the cores instead of oversubscribing them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    pool = GpuPool(gpu_slots) if gpu_slots else None
    active: list[Active] = []
    done = 0
    try:
        while pending or active:
            while pending and len(active) < jobs:
                run = pending.pop(0)
                slot = pool.take() if pool else None
                try:
                    a = _start(grid, run, runs_dir, timeout_s, env, slot)
                except OSError as exc:  # e.g. the launcher cannot be executed: this run fails, the others go on
                    if slot is not None:
                        pool.give(slot)
                    outcomes[run.name] = {"name": run.name, "status": "failed", "returncode": None, "seconds": 0.0,
                                          "message": f"could not start: {exc}"}
                    done += 1
                    print(f"[sweep] failed   {run.name}: could not start: {exc}", flush=True)
                    continue
                active.append(a)
                print(f"[sweep] start  {a.run.name}  (log: {os.path.join(a.run_dir, 'log.txt')})"
                      + (f"  CUDA_VISIBLE_DEVICES={slot}" if slot is not None else ""), flush=True)
            time.sleep(0.2)
            for a in list(active):
                if a.proc.poll() is not None:
                    outcome = _finish(a, "exited")
                elif time.monotonic() > a.deadline:
                    process.stop([a.proc], grace)
                    outcome = _finish(a, "timeout", f"exceeded its timeout of {timeout_s / 60:g} min (timeout_minutes "
                                                    f"in {grid.path}, or --timeout_minutes) and was killed")
                else:
                    continue
                active.remove(a)
                if a.gpu_slot is not None:
                    pool.give(a.gpu_slot)
                outcomes[a.run.name] = outcome
                done += 1
                total = done + len(active) + len(pending)
                line = f"[sweep] [{done}/{total}] {outcome['status']:<8} {a.run.name}  {outcome['seconds']:.0f}s"
                if pending:  # the runs still queued, as estimated from the runs measured so far
                    left, _ = estimate(grid, pending, runs_dir)
                    line += f"  ({len(pending)} queued: ~{duration(left)})" if left else ""
                if outcome["status"] != "finished":
                    line += f"\n         {outcome['message']}\n         log: {os.path.join(a.run_dir, 'log.txt')}"
                print(line, flush=True)
    except KeyboardInterrupt:
        print(f"[sweep] interrupted: stopping {len(active)} running run(s) (SIGTERM, SIGKILL after {grace:g}s; "
              "Ctrl-C again to kill now)", flush=True)
        process.stop([a.proc for a in active], grace)
        for a in active:
            outcomes[a.run.name] = _finish(a, "interrupted", "stopped by Ctrl-C / SIGTERM of the sweep")
        for run in pending:
            outcomes[run.name] = {"name": run.name, "status": "not started", "message": "sweep interrupted"}
        write_report(output_dir, grid, runs, outcomes, invocation)
        raise
    write_report(output_dir, grid, runs, outcomes, invocation)
    return [outcomes[r.name] for r in runs]


def write_report(output_dir: str, grid: Grid, runs: list[Run], outcomes: dict[str, dict], invocation: str) -> None:
    """DIR/sweep_report.json (the command, every run's outcome) and DIR/runs.jsonl; both backends end with it."""
    report = {"grid": os.path.abspath(grid.path), "description": grid.description, "command": invocation,
              "runs": [{k: outcomes[r.name].get(k) for k in ("name", "status", "returncode", "seconds", "message")}
                       for r in runs if r.name in outcomes]}
    report["failed"] = [o["name"] for o in report["runs"] if o["status"] not in ("finished", "skipped")]
    with open(os.path.join(output_dir, "sweep_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    write_archive(output_dir)  # every run directory's records in one file: how a grid's results are committed


def print_report(outcomes: list[dict], output_dir: str) -> None:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o["status"]] = counts.get(o["status"], 0) + 1
    print("[sweep] done: " + ", ".join(f"{n} {s}" for s, n in counts.items()), flush=True)
    failed = [o for o in outcomes if o["status"] not in ("finished", "skipped")]
    if failed:
        print(f"[sweep] {len(failed)} run(s) did not finish (rerun the same command to retry them):", flush=True)
        for o in failed:
            print(f"  {o['name']}: {o['status']}: {o['message']}\n    log: "
                  f"{os.path.join(output_dir, 'runs', o['name'], 'log.txt')}", flush=True)
