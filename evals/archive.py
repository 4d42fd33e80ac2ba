"""A sweep's raw per-run records: read from its run directories, or from one compact file, `runs.jsonl`.

    python evals/archive.py outputs/paper_ablation     # writes outputs/paper_ablation/runs.jsonl from runs/*/

A run directory holds a model, a log and a few small files; the table and the plots need only the small files.
`runs.jsonl` keeps those, parsed, one JSON object per run, in run-name order:

    {"name": "online_dpo-N1-seed1",
     "files": {"sweep_run.json": {...}, "config.yaml": {...}, "run_summary.json": {...},
               "eval_results.json": {...}, "metrics.jsonl": [{...}, ...]},
     "unreadable": {"run_summary.json": "<error>"}}          # only when a file could not be parsed

Guarantees:
- a file absent from the run directory is absent from "files"; `log.txt` and the model are never archived (the log
  is machine-specific and long, the model is large);
- `records_from_dirs` and `read_archive` return the same records for the same runs (JSON floats round-trip
  exactly), so a table made from `runs.jsonl` is byte-identical to one made from the directories;
- only directories with a `sweep_run.json` are runs (the sweep writes it first), as in `evals/aggregate.py`;
- a torn last line of metrics.jsonl (a killed run) is dropped, which the table does anyway.
This is why committed results keep one `runs.jsonl` per grid instead of hundreds of per-run files.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import yaml

ARCHIVE = "runs.jsonl"
FILES = ("sweep_run.json", "config.yaml", "run_summary.json", "eval_results.json", "metrics.jsonl")  # archived


def _read_jsonl(path: str) -> list:
    lines = []
    with open(path) as f:
        for text in f:
            try:
                lines.append(json.loads(text))
            except ValueError:  # a torn line of a killed run, or a blank one
                continue
    return lines


def read_run_dir(run_dir: str) -> dict:
    """The raw record of one run directory (see the module docstring)."""
    files, unreadable = {}, {}
    for name in FILES:
        path = os.path.join(run_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            if name.endswith(".jsonl"):
                files[name] = _read_jsonl(path)
            else:
                with open(path) as f:
                    files[name] = json.load(f) if name.endswith(".json") else yaml.safe_load(f)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            unreadable[name] = str(exc)
    record = {"name": os.path.basename(run_dir), "files": files}
    if unreadable:
        record["unreadable"] = unreadable
    return record


def records_from_dirs(runs_dir: str) -> list[dict]:
    """The raw records of every run under runs_dir (directories with a sweep_run.json), in name order."""
    paths = sorted(glob.glob(os.path.join(runs_dir, "*", "sweep_run.json")))
    return [read_run_dir(os.path.dirname(p)) for p in paths]


def write_archive(output_dir: str) -> str | None:
    """Write output_dir/runs.jsonl from output_dir/runs/*/; returns its path (None when there is no run yet). Written
    to a temporary file first, so an interrupted write never leaves half an archive."""
    records = records_from_dirs(os.path.join(output_dir, "runs"))
    if not records:
        return None
    path = os.path.join(output_dir, ARCHIVE)
    with open(path + ".tmp", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(path + ".tmp", path)
    return path


def read_archive(path: str) -> list[dict]:
    """The records of a runs.jsonl, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_records(output_dir: str) -> list[dict]:
    """A sweep's raw records: from its run directories when it has some (a sweep's own output), else from its
    runs.jsonl (committed results), else none."""
    records = records_from_dirs(os.path.join(output_dir, "runs"))
    if records:
        return records
    path = os.path.join(output_dir, ARCHIVE)
    return read_archive(path) if os.path.isfile(path) else []


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Write DIR/runs.jsonl from a sweep's run directories DIR/runs/*/.")
    parser.add_argument("output_dir", help="the --output_dir of launch/sweep.py")
    args = parser.parse_args(argv)
    path = write_archive(args.output_dir)
    if path is None:
        print(f"[archive] {args.output_dir}/runs/: no run directories", file=sys.stderr)
        return 1
    print(f"{path}: {os.path.getsize(path) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # `python evals/archive.py` from a checkout
        sys.path.insert(0, root)
    sys.exit(main(sys.argv[1:]))
