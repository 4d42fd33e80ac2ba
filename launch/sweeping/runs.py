"""The runs of a grid: one per {algorithm} x {knob value} x {extra axes} x {seed}, named after its cell
(`online_dpo-N4-seed1`), with every recipe flag it gets, the command that starts it, and the record the sweep keeps
in its directory (`sweep_run.json`).

Guarantees: `expand` returns the runs in grid order with distinct names (or raises GridError); `check_run_dirs`
refuses, before anything starts, a finished run whose recorded flags differ from the grid's (its numbers would
silently mix two settings in one cell), a directory the sweep did not make, and a run an earlier, killed sweep
left running (a local process group, or a Slurm job still queued or running). A record is replaced atomically
(written aside, then renamed), so a reader never sees half of one.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass

import yaml

from evals.run_result import run_finished
from launch.sweeping import ROOT, slurm_queue
from launch.sweeping.grid import KNOBS, Grid, GridError
from launch.sweeping.process import still_running
from launch.sweeping.recipe_flags import task_defaults


@dataclass(frozen=True)
class Run:
    """One cell x seed: everything needed to start it and to recognise it later."""

    name: str
    algorithm: str
    recipe: str
    knob: str
    knob_value: int
    seed: int
    axes: dict  # extra-axis flag -> value
    flags: dict  # every recipe flag of this run except output_dir (written to its config.yaml)
    expects_eval: bool  # the task writes eval_results.json (the built-in task with eval_prompts > 0)
    index: int = 0  # position in the grid (the table and plots keep the grid's order)


def _label(value) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", str(value)).strip("_") or "x"


def expand(grid: Grid) -> list[Run]:
    """Every run of the grid, in order: algorithm, knob value, extra axes, seed."""
    runs = []
    axis_names = list(grid.axes)
    for a in grid.algorithms:
        # a script outside recipes/ is assumed to take the task flags every recipe takes (async_rlhf.tasks.setup)
        defaults = grid.recipe_options.get(a.recipe) or task_defaults()
        for value in grid.knob_values:
            for combo in itertools.product(*(grid.axes[k] for k in axis_names)):
                axes = dict(zip(axis_names, combo))
                for seed in grid.seeds:
                    name = "-".join([a.name, f"{KNOBS[grid.knob]}{value}"]
                                    + [f"{k}{_label(v)}" for k, v in axes.items()] + [f"seed{seed}"])
                    flags = {**grid.flags, **a.flags, **axes, grid.knob: value, "seed": seed}
                    runs.append(Run(name, a.name, a.recipe, grid.knob, value, seed, axes, flags,
                                    _expects_eval(flags, defaults), index=len(runs)))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:  # e.g. axis values 'a/b' and 'a_b' both label as a_b
        raise GridError(f"{grid.path}: axes: runs would share directory names {duplicates}")
    return runs


def _expects_eval(flags: dict, defaults: dict) -> bool:
    """async_rlhf/tasks/setup.py: only the built-in task evaluates (eval_results.json), and only with eval_prompts > 0."""
    if "task" not in defaults:
        return False
    return flags.get("task", defaults["task"]) == "builtin" and (flags.get("eval_prompts", defaults.get("eval_prompts"))
                                                                or 0) > 0


def command(grid: Grid, run: Run, run_dir: str) -> list[str]:
    """`accelerate launch` (or `python`) of the run's recipe with `--config` on the run's config.yaml."""
    config = os.path.join(run_dir, "config.yaml")
    if grid.launcher == "python":
        return [sys.executable, run.recipe, "--config", config]
    # `python -m accelerate.commands.launch` is `accelerate launch` of this very interpreter
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if grid.accelerate_config:
        launch += ["--config_file", grid.accelerate_config]
    return launch + [run.recipe, "--config", config]


def prepare_run_dir(grid: Grid, run: Run, runs_dir: str, status: str, **extra) -> tuple[str, list[str], dict]:
    """Empty the run's directory and write its config.yaml and sweep_run.json (with `status` and `extra` fields);
    returns (run_dir, command, record). Both backends start a run this way."""
    run_dir = os.path.join(runs_dir, run.name)
    if os.path.isdir(run_dir):  # an unfinished attempt (checked by check_run_dirs): start clean, since the recipe
        shutil.rmtree(run_dir)  # appends to metrics.jsonl and a half-written one would mix two attempts
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump({**run.flags, "output_dir": run_dir}, f, sort_keys=False)
    cmd = command(grid, run, run_dir)
    record = {"name": run.name, "algorithm": run.algorithm, "recipe": rel(run.recipe), "knob": run.knob,
              "knob_value": run.knob_value, "seed": run.seed, "axes": run.axes, "flags": run.flags,
              "expects_eval": run.expects_eval, "index": run.index, "command": cmd, "grid": os.path.abspath(grid.path),
              "status": status, "returncode": None, "seconds": None, "message": "", **extra}
    write_record(run_dir, record)
    return run_dir, cmd, record


def read_record(run_dir: str) -> dict | None:
    """A run directory's sweep_run.json; None when there is none or it is not JSON (not made by the sweep)."""
    try:
        with open(os.path.join(run_dir, "sweep_run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_record(run_dir: str, record: dict) -> None:
    """Replace sweep_run.json atomically (written aside, then renamed): a reader never sees half of one."""
    tmp = os.path.join(run_dir, "sweep_run.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(run_dir, "sweep_run.json"))


def rel(path: str) -> str:
    """Recipe paths are recorded relative to the checkout, so a moved checkout still recognises its runs."""
    relative = os.path.relpath(path, ROOT)
    return path if relative.startswith("..") else relative


def check_run_dirs(runs: list[Run], runs_dir: str, grid_path: str) -> None:
    """Before anything starts. A finished run made with other flags would be skipped and silently mixed into this
    grid's table: refuse. A run directory the sweep did not make, or whose run is still going (an earlier sweep
    was killed), would be emptied on retry: refuse too."""
    changed = []
    for run in runs:
        run_dir = os.path.join(runs_dir, run.name)
        record = read_record(run_dir)
        if record is None:
            if os.path.isdir(run_dir) and os.listdir(run_dir):
                raise GridError(f"{run_dir} exists but was not made by the sweep (no sweep_run.json); move it away")
            continue
        job = record.get("job_id") if record.get("status") in ("queued", "running", "requeued") else None
        state = slurm_queue.active(job) if job else None
        if state:
            raise GridError(f"{run.name} is still {state.lower()} as Slurm job {job} of an earlier sweep; wait for it "
                            f"(`python launch/sweep.py --status DIR`) or cancel it with `scancel {job.split('_')[0]}`, "
                            "then rerun")
        pgid = still_running(run_dir, record)
        if pgid:
            raise GridError(f"{run.name} is still running from an earlier sweep (process group {pgid}); wait for it "
                            f"or stop it with `kill -- -{pgid}`, then rerun")
        if not run_finished(run_dir, run.expects_eval):
            continue
        old = record.get("flags", {})
        diff = sorted(k for k in set(old) | set(run.flags) if old.get(k) != run.flags.get(k))
        if diff or record.get("recipe") != rel(run.recipe):
            changed.append(f"  {run.name}: " + (", ".join(f"{k} {old.get(k)!r} -> {run.flags.get(k)!r}" for k in diff)
                                               or f"recipe {record.get('recipe')} -> {rel(run.recipe)}"))
    if changed:
        raise GridError(f"{grid_path}: these runs finished earlier with different settings:\n" + "\n".join(changed)
                        + f"\nUse another --output_dir, or delete those directories under {runs_dir} to rerun them.")


def split_finished(runs: list[Run], runs_dir: str) -> tuple[dict[str, dict], list[Run]]:
    """(outcome of each run finished earlier, as 'skipped'; the runs still to do), by their run directories."""
    outcomes, pending = {}, []
    for run in runs:
        if run_finished(os.path.join(runs_dir, run.name), run.expects_eval):
            outcomes[run.name] = {"name": run.name, "status": "skipped", "message": "finished earlier"}
        else:
            pending.append(run)
    return outcomes, pending
