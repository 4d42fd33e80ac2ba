"""A sweep's results from its raw run records: one table (markdown and CSV) and the plots.

    python evals/aggregate.py outputs/paper_ablation          # a sweep's output: reads runs/*/
    python evals/aggregate.py evals/results/long_ablation     # committed results: reads runs.jsonl
    python evals/aggregate.py evals/results/sorting_ppo_192 --sft_baseline evals/results/sorting_policy_size/sft_baseline.json

Writes results.md, results.csv and plots/*.png into the directory it reads. The records come from `DIR/runs/*/` as
launch/sweep.py leaves them when there are any, else from `DIR/runs.jsonl` (evals/archive.py), which holds the
same files parsed; both give byte-identical tables. Per run it reads `sweep_run.json` (the cell: algorithm, knob
and its value, extra axes, seed; the run's total seconds), `run_summary.json` (wall and loop seconds, samples,
staleness histogram, dropped batches), `metrics.jsonl` (one line per logged step: training metrics, and evaluation
metrics at eval steps) and, when the task evaluates, `eval_results.json` (the final gold evaluation). A cell is
{algorithm} x {knob value} x {extra axes}; its numbers are the mean and the sample standard deviation (ddof 1)
over the seeds that finished (no std for a single seed). Unfinished runs are left out and listed under the table.
`--sft_baseline FILE` (evals/sorting_sft_baseline.py's `{size: metrics}`) draws the SFT policy's gold reward and
win-rate as the plots' reference line, for the size every run trained (its `sorting_policy` flag, default `default`).

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


class BaselineError(ValueError):
    """An SFT baseline file that cannot give the runs' reference."""


def sft_baseline(path: str, runs) -> dict:
    """The SFT policy's metrics from a `{size: metrics}` file, for the one policy size the runs trained."""
    with open(path) as f:
        try:
            sizes = json.load(f)
        except json.JSONDecodeError as e:
            raise BaselineError(f"{path}: not JSON ({e})") from e
    trained = sorted({str(r.flags.get("sorting_policy", "default")) for r in runs})
    if len(trained) != 1:
        raise BaselineError(f"{path}: the runs trained policies of {len(trained)} sizes ({', '.join(trained)}); "
                            "one reference line needs one size")
    if not isinstance(sizes, dict) or not isinstance(sizes.get(trained[0]), dict):
        have = ", ".join(sizes) if isinstance(sizes, dict) else type(sizes).__name__
        raise BaselineError(f"{path}: no entry for the runs' policy size {trained[0]!r} (it has: {have})")
    return sizes[trained[0]]


def aggregate(output_dir: str, plots: bool = True, sft_baseline_path: str | None = None) -> list[str]:
    """Write results.md, results.csv and plots/*.png for the sweep in output_dir. Returns the paths written
    (none when no run has finished yet). `sft_baseline_path`: see the module's docstring."""
    runs, unfinished = load_runs(output_dir)
    if not runs:
        print(f"[aggregate] {output_dir}: no finished runs yet ({len(unfinished)} unfinished); nothing to write",
              flush=True)
        return []
    sft = sft_baseline(sft_baseline_path, runs) if sft_baseline_path else None
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
        written = draw_all(cells, os.path.join(output_dir, "plots"), sft=sft)
    csv_path, md_path = os.path.join(output_dir, "results.csv"), os.path.join(output_dir, "results.md")
    write_csv(rows, csv_path)
    write_markdown(rows, unfinished, md_path, written, description, command)
    return [md_path, csv_path] + written


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Table (results.md, results.csv) and plots (plots/*.png) of a sweep.")
    parser.add_argument("output_dir", help="the --output_dir of launch/sweep.py, or a grid under evals/results/")
    parser.add_argument("--no_plots", action="store_true")
    parser.add_argument("--sft_baseline", default=None, metavar="FILE",
                        help="the SFT policy's evaluation by size (evals/sorting_sft_baseline.py), drawn as the plots' "
                             "reference line")
    args = parser.parse_args(argv)
    try:
        written = aggregate(args.output_dir, plots=not args.no_plots, sft_baseline_path=args.sft_baseline)
    except (BaselineError, OSError) as e:
        parser.error(str(e))
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
