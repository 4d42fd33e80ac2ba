"""`python launch/sweep.py --status DIR`: each cell of a sweep as queued, running, finished, failed or requeued (or
not started), from the scheduler (Slurm cells: `squeue`) and the run directories (both backends).

Guarantees: reads only (writes nothing, submits and cancels nothing); works without Slurm (Slurm cells are then
judged by their records, and the header says the scheduler could not be asked); every cell of the grid the sweep
ran (its copy DIR/grid.yaml) is listed, also those never started, else every run directory. Exit code 0, or 2 when
DIR is not a sweep's output directory.
"""

from __future__ import annotations

import os

from evals.run_result import run_finished
from launch.sweeping import slurm_queue
from launch.sweeping.grid import GridError, load_grid
from launch.sweeping.process import still_running
from launch.sweeping.runs import expand, read_record


def _cells(output_dir: str) -> list[tuple[str, bool]]:
    """(run name, expects eval_results.json) of every cell: the grid's when DIR/grid.yaml loads, else the runs'."""
    runs_dir = os.path.join(output_dir, "runs")
    grid_copy = os.path.join(output_dir, "grid.yaml")
    if os.path.isfile(grid_copy):
        try:
            return [(r.name, r.expects_eval) for r in expand(load_grid(grid_copy))]
        except (GridError, KeyError):
            pass
    names = sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []
    return [(n, bool((read_record(os.path.join(runs_dir, n)) or {}).get("expects_eval"))) for n in names]


def cell_states(output_dir: str) -> tuple[list[dict], bool | None]:
    """([{name, state, detail, job_id}], whether squeue answered: None when no cell is a Slurm cell)."""
    runs_dir = os.path.join(output_dir, "runs")
    cells = _cells(output_dir)
    records = {name: read_record(os.path.join(runs_dir, name)) for name, _ in cells}
    job_ids = [r["job_id"] for r in records.values() if r and r.get("job_id")]
    entries = slurm_queue.query(job_ids) if job_ids else None
    out = []
    for name, expects_eval in cells:
        run_dir = os.path.join(runs_dir, name)
        record = records[name]
        job = (record or {}).get("job_id")
        entry = entries.get(job) if entries is not None and job else None
        state, detail = slurm_queue.cell_state(record, run_finished(run_dir, expects_eval), entry)
        if entries is None and job and state == "failed" and record.get("status") in ("queued", "running", "requeued"):
            state, detail = record["status"], "as last recorded (squeue did not answer)"
        if not job and state == "running" and not still_running(run_dir, record):
            state, detail = "failed", "recorded running, but no process of it is left (its sweep was killed)"
        out.append({"name": name, "state": state, "detail": detail, "job_id": job})
    return out, (None if not job_ids else entries is not None)


def print_status(output_dir: str) -> int:
    if not any(os.path.exists(os.path.join(output_dir, name)) for name in ("runs", "grid.yaml")):
        print(f"[sweep] error: {output_dir} is not a sweep's output directory (no runs/, no grid.yaml)")
        return 2
    cells, asked = cell_states(output_dir)
    counts: dict[str, int] = {}
    for c in cells:
        counts[c["state"]] = counts.get(c["state"], 0) + 1
    print(f"{output_dir}: {len(cells)} cells: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + ({None: "", True: " (Slurm asked)", False: " (squeue did not answer: Slurm cells as recorded)"}[asked]))
    width = max((len(c["name"]) for c in cells), default=0)
    for c in cells:
        print(f"  {c['name']:<{width}}  {c['state']:<11}" + (f"  job {c['job_id']}" if c["job_id"] else "")
              + (f"  {c['detail']}" if c["detail"] else ""))
    return 0
