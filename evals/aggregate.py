"""A sweep's results from its raw run records: one table (markdown and CSV) and the plots.

    python evals/aggregate.py outputs/paper_ablation          # a sweep's output: reads runs/*/
    python evals/aggregate.py evals/results/long_ablation     # committed results: reads runs.jsonl

Writes results.md, results.csv and plots/*.png into the directory it reads. The records come from `DIR/runs/*/` as
launch/sweep.py leaves them when there are any, else from `DIR/runs.jsonl` (evals/archive.py), which holds the
same files parsed; both give byte-identical tables. Per run it reads `sweep_run.json` (the cell: algorithm, knob
and its value, extra axes, seed; the run's total seconds), `run_summary.json` (wall and loop seconds, samples,
staleness histogram, dropped batches), `metrics.jsonl` (one line per logged step: training metrics, and evaluation
metrics at eval steps) and, when the task evaluates, `eval_results.json` (the final gold evaluation). A cell is
{algorithm} x {knob value} x {extra axes}; its numbers are the mean and the sample standard deviation (ddof 1)
over the seeds that finished (no std for a single seed). Unfinished runs are left out and listed under the table.

The data flows one way: archive.py (raw records) -> run_result.py (one run's numbers) -> cells.py (statistics
over seeds) -> table.py and plots.py (labels.py names the score for both) -> this module, which only wires them.
"""

from __future__ import annotations

import json
import os
import sys

if __package__ in (None, ""):  # `python evals/aggregate.py` from a checkout: `evals` is imported from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals.cells import group_cells  # noqa: E402
from evals.plots import draw_all  # noqa: E402
from evals.run_result import load_runs  # noqa: E402
from evals.table import table_rows, write_csv, write_markdown  # noqa: E402


def aggregate(output_dir: str, plots: bool = True) -> list[str]:
    """Write results.md, results.csv and plots/*.png for the sweep in output_dir. Returns the paths written
    (none when no run has finished yet)."""
    runs, unfinished = load_runs(output_dir)
    if not runs:
        print(f"[aggregate] {output_dir}: no finished runs yet ({len(unfinished)} unfinished); nothing to write",
              flush=True)
        return []
    cells = group_cells(runs)
    rows = table_rows(cells)
    description, command = "", ""
    report_path = os.path.join(output_dir, "sweep_report.json")
    if os.path.isfile(report_path):
        with open(report_path) as f:
            report = json.load(f)
        description, command = report.get("description", ""), report.get("command", "")
    written = []
    if plots:
        written = draw_all(cells, os.path.join(output_dir, "plots"))
    csv_path, md_path = os.path.join(output_dir, "results.csv"), os.path.join(output_dir, "results.md")
    write_csv(rows, csv_path)
    write_markdown(rows, unfinished, md_path, written, description, command)
    return [md_path, csv_path] + written


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Table (results.md, results.csv) and plots (plots/*.png) of a sweep.")
    parser.add_argument("output_dir", help="the --output_dir of launch/sweep.py, or a grid under evals/results/")
    parser.add_argument("--no_plots", action="store_true")
    args = parser.parse_args(argv)
    written = aggregate(args.output_dir, plots=not args.no_plots)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
