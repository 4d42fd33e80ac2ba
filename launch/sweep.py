"""How off-policy can I go, and what does it buy me? One command: a grid of recipe runs, then a table and plots.

    python launch/sweep.py --quick --output_dir outputs/sweep_quick                # toy task, a few minutes on CPU
    python launch/sweep.py --config launch/sweeps/paper_ablation.yaml --output_dir outputs/paper_ablation
    python launch/sweep.py --config launch/sweeps/async_vs_sync.yaml --output_dir outputs/async_vs_sync --dry_run
    python evals/aggregate.py outputs/paper_ablation                               # table and plots again
    python launch/sweep.py --quick --output_dir outputs/sweep_quick --backend slurm --cpus_per_run 1   # a Slurm array
    python launch/sweep.py --status outputs/sweep_quick                            # each cell's state

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
  step, measured on this sweep's finished runs of the same algorithm, else the grid's `estimate`); with
  `--backend slurm` also the batch script, after the cluster's checks;
- `--gpus_per_run G` with `jobs` K (local backend): each running run gets its own G GPUs as CUDA_VISIBLE_DEVICES;
  K x G beyond the visible GPUs is refused before anything starts, naming both numbers (launch/sweeping/gpus.py);
- `--backend slurm` (launch/sweeping/slurm.py): one Slurm array task per unfinished cell, through submitit, with the
  same run directories, records, report and table; every resource is checked before anything is submitted; Ctrl-C
  cancels the array; a cell told its time limit is near (or preempted) checkpoints, is requeued and resumes
  (launch/sweeping/cell_task.py);
- `--status DIR` prints each cell as queued, running, finished, failed or requeued (launch/sweeping/status.py).
The work is done in launch/sweeping/ (its __init__ maps the modules); this file is only the command line.
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
from evals.run_result import run_finished  # noqa: E402
from launch.sweeping import slurm  # noqa: E402
from launch.sweeping.estimate import print_plan  # noqa: E402
from launch.sweeping.gpus import plan_slots, visible_gpus  # noqa: E402
from launch.sweeping.grid import GridError, load_grid  # noqa: E402
from launch.sweeping.runs import check_run_dirs, expand  # noqa: E402
from launch.sweeping.schedule import print_report, run_sweep  # noqa: E402
from launch.sweeping.status import print_status  # noqa: E402

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
    parser.add_argument("--output_dir", help="runs go to OUTPUT_DIR/runs/<name>/, the table and plots "
                                              "to OUTPUT_DIR/results.{md,csv} and OUTPUT_DIR/plots/ (required)")
    parser.add_argument("--status", metavar="DIR", help="print each cell of the sweep in DIR as queued, running, "
                                                        "finished, failed or requeued, and exit")
    parser.add_argument("--backend", choices=("local", "slurm"), default="local",
                        help="local: `jobs` runs at a time on this machine (default); slurm: one array task per cell")
    parser.add_argument("--gpus_per_run", type=int, help="GPUs of one run (overrides the grid's `gpus_per_run`; "
                                                         "local: jobs x gpus_per_run must fit the visible GPUs)")
    parser.add_argument("--jobs", type=int, help="runs at a time (overrides the grid's `jobs`)")
    parser.add_argument("--timeout_minutes", type=float, help="per-run limit (overrides the grid's `timeout_minutes`)")
    parser.add_argument("--grace_seconds", type=float, default=30.0,
                        help="SIGTERM -> SIGKILL delay when stopping a run")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="only runs whose name contains TEXT (repeatable: any of them)")
    parser.add_argument("--dry_run", action="store_true",
                        help="validate, print the plan and a time estimate, write nothing")
    parser.add_argument("--no_aggregate", action="store_true", help="skip the table and plots at the end")
    cluster = parser.add_argument_group("--backend slurm (override the grid's `slurm:` keys)")
    cluster.add_argument("--nodes_per_run", type=int, help="nodes of one cell (default 1)")
    cluster.add_argument("--cpus_per_run", type=int, help="CPUs of one cell on each node (default 1)")
    cluster.add_argument("--mem_gb", type=float, help="memory of one cell on each node, GB")
    cluster.add_argument("--partition", help="the partition (default: the cluster's default)")
    cluster.add_argument("--account", help="the account to charge")
    cluster.add_argument("--sbatch", action="append", default=[], metavar="OPTION=VALUE",
                         help="a further sbatch option, passed through (repeatable), e.g. --sbatch qos=high")
    cluster.add_argument("--signal_delay_s", type=int,
                         help=f"seconds before the time limit at which a cell checkpoints and is requeued "
                              f"(default {slurm.DEFAULT_SIGNAL_DELAY_S})")
    cluster.add_argument("--poll_seconds", type=float, default=5.0, help="how often the sweep asks Slurm (default 5)")
    args = parser.parse_args(argv)
    if args.status:
        return print_status(os.path.abspath(args.status))
    if not args.output_dir:
        parser.error("the following arguments are required: --output_dir (or give --status DIR)")
    sbatch = {}
    for option in args.sbatch:
        if "=" not in option:
            parser.error(f"--sbatch {option}: give OPTION=VALUE (e.g. qos=high)")
        key, value = option.split("=", 1)
        sbatch[key] = value
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
    grid.gpus_per_run = grid.gpus_per_run if args.gpus_per_run is None else args.gpus_per_run
    slots, script, resources = None, None, None
    try:  # every resource check before anything starts or is submitted
        if args.backend == "local":
            slots = plan_slots(grid.jobs, grid.gpus_per_run, *visible_gpus())
        else:
            resources = slurm.resources(grid, {
                "nodes_per_run": args.nodes_per_run, "cpus_per_run": args.cpus_per_run, "mem_gb": args.mem_gb,
                "partition": args.partition, "account": args.account, "sbatch": sbatch,
                "signal_delay_s": args.signal_delay_s, "jobs": args.jobs})
            todo = [r for r in runs if not run_finished(os.path.join(output_dir, "runs", r.name), r.expects_eval)]
            script = slurm.render(resources, output_dir, max(1, len(todo)), slurm.job_name(output_dir))
            if args.dry_run and not slurm.slurm_here():  # show the plan and script on a machine without Slurm
                script += "\n# (not checked against a cluster: no sbatch / sinfo on this machine)"
            elif todo or not args.dry_run:
                slurm.check_cluster(resources, script)
    except GridError as exc:
        print(f"[sweep] error: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.dry_run:
        print_plan(grid, runs, output_dir)
        if slots:
            print("GPU slots (CUDA_VISIBLE_DEVICES, one per running run): " + "  ".join(slots))
        if script is not None:
            print(f"Slurm: one array task per run to go; each cell's allocation: {resources}\nbatch script "
                  f"(submitted through submitit; the cells' logs stay in runs/<name>/log.txt):\n{script}", flush=True)
        return 0
    os.makedirs(output_dir, exist_ok=True)
    shutil.copyfile(grid_path, os.path.join(output_dir, "grid.yaml"))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill <sweep>` stops its runs like Ctrl-C does
    try:
        if args.backend == "slurm":
            outcomes = slurm.run_slurm_sweep(grid, runs, output_dir, resources, args.grace_seconds,
                                             invocation=_invocation(argv), poll_s=args.poll_seconds)
        else:
            outcomes = run_sweep(grid, runs, output_dir, args.grace_seconds, invocation=_invocation(argv),
                                 gpu_slots=slots)
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
