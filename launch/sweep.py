"""How off-policy can I go, and what does it buy me? One command: a grid of recipe runs, then a table and plots.

    python launch/sweep.py --quick --output_dir outputs/sweep_quick                # toy task, a few minutes on CPU
    python launch/sweep.py --config launch/sweeps/paper_ablation.yaml --output_dir outputs/paper_ablation
    python launch/sweep.py --config launch/sweeps/async_vs_sync.yaml --output_dir outputs/async_vs_sync --dry_run
    python evals/aggregate.py outputs/paper_ablation                               # table and plots again

A grid file (`launch/sweeps/*.yaml`, keys in `GRID_KEYS` of launch/sweeping/grid.py, format in docs/sweeps.md) names the algorithms
(each a recipe), the values of the off-policy knob (`num_mini_batches`, the paper's N, or `max_staleness`), the
seeds, the recipe flags every run shares, and optional extra axes (any recipe flag). Every cell of
{algorithm} x {knob} x {extra axes} x {seed} is one `accelerate launch` (or `python`) of its recipe.

Guarantees:
- the grid is validated completely before anything starts: unknown keys, unknown algorithms, empty or repeated axis
  values, flags the recipe does not have, flags the sweep owns; each error names the file and the key;
- a run lives in `DIR/runs/<name>/`, its name encodes its cell (`online_dpo-N4-seed1`); the sweep writes there the
  run's `config.yaml` (every recipe flag of that cell; the recipe is started with `--config` on it), `log.txt`
  (its stdout and stderr) and `sweep_run.json` (cell, command, status, exit code, seconds); the recipe writes
  `metrics.jsonl`, `run_summary.json`, the model and, when its task evaluates, `eval_results.json`;
- a run is finished when `run_summary.json` exists (and `eval_results.json`, when the task evaluates): finished
  runs are skipped; any other run directory is emptied and the run started again. A finished run whose recorded
  flags differ from the grid's is an error before anything starts (its results would silently mix two settings);
- a run that fails or outlives its timeout is reported with its log and error line; the others still run. The
  exit code is 1 when any run did not finish;
- each run is its own process group: a timeout, Ctrl-C or SIGTERM sends it SIGTERM (the recipe checkpoints and
  stops), then SIGKILL after `--grace_seconds`; a second Ctrl-C kills at once. The sweep then exits with 130;
- at the end (also when interrupted) `DIR/sweep_report.json` holds every run's status and `DIR/runs.jsonl` every
  run's records in one file (evals/archive.py), which is what a grid's results under evals/results/ keep;
- `--dry_run` writes nothing: it prints the plan and a time estimate (per run: start-up + max_steps x seconds per
  step, measured on this sweep's finished runs of the same algorithm, else the grid's `estimate`).
The work is done in launch/sweeping/ (grid.py, runs.py, estimate.py, process.py, schedule.py; its __init__ maps
them); this file is only the command line.
Exit codes: 0 every run finished, 1 some run failed or timed out, 2 invalid grid (nothing ran), 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python launch/sweep.py` from a checkout: `launch.sweeping` and `evals` are found from it
    sys.path.insert(0, ROOT)

from evals.aggregate import aggregate  # noqa: E402
from launch.sweeping.estimate import print_plan  # noqa: E402
from launch.sweeping.grid import GridError, load_grid  # noqa: E402
from launch.sweeping.runs import check_run_dirs, expand  # noqa: E402
from launch.sweeping.schedule import print_report, run_sweep  # noqa: E402

QUICK_GRID = os.path.join(ROOT, "launch", "sweeps", "quick.yaml")
DEFAULT_GRID = os.path.join(ROOT, "launch", "sweeps", "paper_ablation.yaml")


def _invocation(argv: list[str]) -> str:
    """The command line that made this sweep, for results.md ("Made by")."""
    script = os.path.relpath(os.path.abspath(__file__), ROOT)
    return " ".join(["python", script] + [shlex.quote(a) for a in argv])


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"grid file (default: {os.path.relpath(DEFAULT_GRID, ROOT)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"the minutes-scale grid {os.path.relpath(QUICK_GRID, ROOT)}")
    parser.add_argument("--output_dir", required=True, help="runs go to OUTPUT_DIR/runs/<name>/, the table and plots "
                                                            "to OUTPUT_DIR/results.{md,csv} and OUTPUT_DIR/plots/")
    parser.add_argument("--jobs", type=int, help="runs at a time (overrides the grid's `jobs`)")
    parser.add_argument("--timeout_minutes", type=float, help="per-run limit (overrides the grid's `timeout_minutes`)")
    parser.add_argument("--grace_seconds", type=float, default=30.0,
                        help="SIGTERM -> SIGKILL delay when stopping a run")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="only runs whose name contains TEXT (repeatable: any of them)")
    parser.add_argument("--dry_run", action="store_true",
                        help="validate, print the plan and a time estimate, write nothing")
    parser.add_argument("--no_aggregate", action="store_true", help="skip the table and plots at the end")
    args = parser.parse_args(argv)
    if args.quick and args.config:
        parser.error("--quick is the grid launch/sweeps/quick.yaml; give --quick or --config, not both")
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.timeout_minutes is not None and args.timeout_minutes <= 0:
        parser.error("--timeout_minutes must be > 0")
    grid_path = QUICK_GRID if args.quick else (args.config or DEFAULT_GRID)
    output_dir = os.path.abspath(args.output_dir)
    try:
        grid = load_grid(grid_path)
        runs = expand(grid)
        if args.only:
            runs = [r for r in runs if any(text in r.name for text in args.only)]
            if not runs:
                raise GridError(f"--only {args.only}: no run of {grid_path} matches")
        check_run_dirs(runs, os.path.join(output_dir, "runs"), grid_path)
    except GridError as exc:
        print(f"[sweep] error: {exc}", file=sys.stderr, flush=True)
        return 2
    grid.jobs = args.jobs or grid.jobs
    grid.timeout_minutes = args.timeout_minutes or grid.timeout_minutes
    if args.dry_run:
        print_plan(grid, runs, output_dir)
        return 0
    os.makedirs(output_dir, exist_ok=True)
    shutil.copyfile(grid_path, os.path.join(output_dir, "grid.yaml"))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill <sweep>` stops its runs like Ctrl-C does
    try:
        outcomes = run_sweep(grid, runs, output_dir, args.grace_seconds, invocation=_invocation(argv))
    except KeyboardInterrupt:
        print("[sweep] stopped; rerun the same command to continue where it left off", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(outcomes, output_dir)
    if not args.no_aggregate:
        written = aggregate(output_dir)
        if written:
            print("[sweep] results: " + ", ".join(os.path.relpath(p, output_dir) for p in written), flush=True)
    return 0 if all(o["status"] in ("finished", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
