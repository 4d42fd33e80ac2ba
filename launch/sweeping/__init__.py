"""The staleness sweep behind `python launch/sweep.py` (the command-line entry), split by responsibility:

    recipe_flags.py  which recipes the sweep runs, and the flags each accepts (a static table of their dataclasses)
    grid.py          a grid file read and validated completely, before anything starts
    runs.py          the grid expanded into runs: names, flags, commands, and the records in their directories
    estimate.py      the plan and its cost (--dry_run, progress lines)
    process.py       one run as its own process group: start, stop (SIGTERM, then SIGKILL), its error line
    schedule.py      runs `jobs` at a time under their timeouts; sweep_report.json and runs.jsonl at the end
    gpus.py          GPU slots for the local runner: each running run its own CUDA_VISIBLE_DEVICES
    slurm.py         the Slurm backend on the submitting machine: a cell's allocation, the checks, the batch script,
                     submit the unfinished cells as one submitit array, watch it, cancel it
    cell_task.py     what an array task runs inside its allocation: the recipe, its record, checkpoint and requeue
    slurm_queue.py   squeue read into each cell's state (no submitit: also used without Slurm)
    status.py        `--status DIR`: each cell's state from the scheduler and the run directories

A grid flows grid.py -> runs.py -> schedule.py (which uses process.py, estimate.py and gpus.py) or slurm.py (which
submits cell_task.py); evals/ turns the finished runs into the table and the plots. Nothing here imports
launch/sweep.py, so the package never shadows it.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
