"""What a sweep will do and how long it will take: the plan `--dry_run` prints, and the time estimate of the runs
still to go (also on the sweep's first line and its progress lines).

Per run: start-up + max_steps x seconds per step, from this sweep's finished runs of the same algorithm when there
are some (start-up = the run's process seconds - its training-loop seconds), else from the grid's `estimate`;
runs start in order on the first free of `jobs` slots. Unknown when neither is available; reading never fails on a
half-written run directory (it is skipped). Nothing is written.
"""

from __future__ import annotations

import glob
import json
import math
import os

from evals.run_result import run_finished
from launch.sweeping import ROOT
from launch.sweeping.grid import KNOBS, Grid
from launch.sweeping.runs import Run, command, read_record, rel


def duration(seconds: float) -> str:
    """A duration as a person reads it: seconds under two minutes, minutes under two hours, else hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _measured(runs_dir: str) -> dict[str, dict]:
    """{algorithm: {"startup_seconds", "seconds_per_step", "runs"}} from the finished runs in runs_dir: start-up is
    everything but the training loop (imports, generator start, save, final evaluation)."""
    samples: dict[str, list[tuple[float, float]]] = {}
    for record_path in glob.glob(os.path.join(runs_dir, "*", "sweep_run.json")):
        run_dir = os.path.dirname(record_path)
        record = read_record(run_dir)
        if not record or record.get("status") != "finished" or not record.get("seconds"):
            continue
        try:
            with open(os.path.join(run_dir, "run_summary.json")) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            continue
        loop, steps = summary.get("loop_seconds") or 0.0, summary.get("steps") or 0
        if steps > 0 and 0 < loop <= record["seconds"]:
            samples.setdefault(record["algorithm"], []).append((record["seconds"] - loop, loop / steps))
    return {alg: {"startup_seconds": sum(s for s, _ in xs) / len(xs),
                  "seconds_per_step": sum(p for _, p in xs) / len(xs), "runs": len(xs)} for alg, xs in samples.items()}


def estimate(grid: Grid, runs: list[Run], runs_dir: str) -> tuple[float | None, list[str]]:
    """(seconds of wall time for the runs still to go, or None when unknown; lines explaining it). Per run:
    start-up + max_steps x seconds per step, from this sweep's finished runs of the same algorithm when there are
    some, else from the grid's `estimate`; divided by `jobs` for runs at a time."""
    measured = _measured(runs_dir)
    todo = [r for r in runs if not run_finished(os.path.join(runs_dir, r.name), r.expects_eval)]
    if not todo:
        return 0.0, ["  nothing to run"]
    per_run, unknown, lines = [], [], []
    for algorithm in dict.fromkeys(r.algorithm for r in todo):
        mine = [r for r in todo if r.algorithm == algorithm]
        if algorithm in measured:
            m = measured[algorithm]
            startup, per_step = m["startup_seconds"], m["seconds_per_step"]
            source = f"measured on {m['runs']} finished run(s) here"
        elif grid.estimate:
            startup, per_step = grid.estimate["startup_seconds"], grid.estimate["seconds_per_step"][algorithm]
            source = f"the grid's `estimate` in {os.path.basename(grid.path)}"
        else:
            unknown.append(algorithm)
            continue
        steps = [r.flags.get("max_steps", (grid.recipe_options.get(r.recipe) or {}).get("max_steps")) for r in mine]
        if not all(isinstance(n, int) and n > 0 for n in steps):
            unknown.append(f"{algorithm} (no max_steps)")
            continue
        seconds = [startup + n * per_step for n in steps]
        per_run += seconds
        lines.append(f"  {algorithm}: {len(mine)} run(s) x ~{duration(sum(seconds) / len(mine))} "
                     f"({startup:.0f} s start-up + max_steps x {per_step:.2g} s; {source})")
    if unknown:
        lines.append(f"  no estimate for {', '.join(unknown)}: give the grid an `estimate` "
                     "(startup_seconds, seconds_per_step), or run one cell first with --only")
    slots = [0.0] * min(grid.jobs, len(todo))  # runs start in order, each on the first free slot
    for seconds in per_run:
        slots[slots.index(min(slots))] += seconds
    bound = math.ceil(len(todo) / grid.jobs) * grid.timeout_minutes * 60
    lines.append(f"  upper bound (every run hitting its {grid.timeout_minutes:g} min timeout): {duration(bound)}")
    return (None if unknown else max(slots)), lines


def print_plan(grid: Grid, runs: list[Run], output_dir: str) -> None:
    """What --dry_run shows: the grid, every run and whether it is done, one full command, the time estimate."""
    runs_dir = os.path.join(output_dir, "runs")
    print(f"grid {os.path.relpath(grid.path, ROOT) if grid.path.startswith(ROOT) else grid.path}"
          + (f": {grid.description}" if grid.description else ""))
    print("  algorithms: " + ", ".join(f"{a.name} ({rel(a.recipe)}" + (f", {a.flags}" if a.flags else "") + ")"
                                       for a in grid.algorithms))
    print(f"  {grid.knob} ({KNOBS[grid.knob]}): {grid.knob_values}   seeds: {grid.seeds}"
          + "".join(f"   {k}: {v}" for k, v in grid.axes.items()))
    print(f"  shared flags: {grid.flags}")
    print(f"  launcher: {grid.launcher}" + (f" --config_file {rel(grid.accelerate_config)}" if grid.accelerate_config
                                            else "") + f"   jobs: {grid.jobs}   timeout: {grid.timeout_minutes:g} min")
    states = {r.name: run_finished(os.path.join(runs_dir, r.name), r.expects_eval) for r in runs}
    todo = [r for r in runs if not states[r.name]]
    print(f"runs in {runs_dir}/ ({len(runs)}: {len(runs) - len(todo)} finished, {len(todo)} to run"
          + ("; each writes eval_results.json" if any(r.expects_eval for r in runs) else "") + "):")
    width = max(len(r.name) for r in runs)
    for r in runs:
        print(f"  {r.name:<{width}}  {'finished (skip)' if states[r.name] else 'to run'}")
    if todo:
        first = todo[0]
        run_dir = os.path.join(runs_dir, first.name)
        print(f"command of {first.name} (its config.yaml holds its flags and output_dir):\n  "
              + " ".join(command(grid, first, run_dir)) + f"\n  flags: {first.flags}")
    seconds, lines = estimate(grid, runs, runs_dir)
    head = "unknown" if seconds is None else f"~{duration(seconds)}"
    print(f"time estimate for the {len(todo)} run(s) to go, {grid.jobs} at a time: {head}")
    print("\n".join(lines), flush=True)
