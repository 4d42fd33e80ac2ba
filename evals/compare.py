"""Differences between sweep cells with their 95% intervals: what a NOTES finding states.

Reads one or more sweep directories (a sweep's `--output_dir`, or committed results with their runs.jsonl) and pools
their finished runs by cell: `ALGORITHM:N` (the algorithm's name in the grid, `,flag=value` for each extra axis of
the grid and for each `--by` flag whose value differs among the pooled runs of that algorithm, such as a learning
rate two grids ran the same algorithm at, and its knob value), seeds merged across directories (a seed that two
directories both ran in one cell is refused: it would count twice). `--by` is named, not guessed: a flag can read
differently in two records of one setting (RLOO's `per_device_train_batch_size` counted prompts before it counted
completions, as TRL's does). Then prints

* every cell: seeds, mean and the 95% t-interval of the mean (sample standard deviation, n - 1 degrees of freedom);
* each contrast asked for: a signed sum of cell means (`A:16 - A:1`; an interaction such as
  `small:16 - small:1 - default:16 + default:1`) with its Welch 95% interval (independent cells, unequal variances,
  Welch-Satterthwaite degrees of freedom; a cell with one seed, as in a `--quick` sweep, gives the difference
  without an interval). With no contrast given: each algorithm's every N against its N = 1;
* a note for each cell whose seeds started from different initial policies (each run's `initial_policy` in
  run_summary.json: a rebuilt SFT policy is another experiment). Records made before runs kept it say nothing.

The value is a final evaluation metric (`--metric`, default the run's score: `gold_win_rate`, else the training
score) or, with `--step S`, the evaluation of that metric logged at step S during training (`gold_eval_steps`).

    python evals/compare.py evals/results/sorting_staleness evals/results/sorting_staleness_seeds45 --metric gold_reward
    python evals/compare.py evals/results/sorting_staleness --metric gold_reward --contrast "ppo_none:16 - ppo_none:1"
    python evals/compare.py evals/results/sorting_staleness_seeds45 evals/results/sorting_ppo_lr3e5 --by learning_rate
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass

from scipy import stats

if __package__ in (None, ""):  # `python evals/compare.py` from a checkout: `evals` is imported from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evals.run_result import RunResult, load_runs  # noqa: E402

TERM = re.compile(r"\s*([+-])?\s*([^\s:+-][^\s:]*):(\d+)\s*")


@dataclass(frozen=True)
class Estimate:
    value: float  # a mean, or a contrast of means
    low: float  # the 95% interval
    high: float
    df: float


def run_value(run: RunResult, metric: str | None, step: int | None) -> float:
    """The run's value: its final `metric` (default: its score), or that metric's evaluation at `step`."""
    if step is not None:
        name = metric or "gold_win_rate"
        points = {s: v for s, _, v in run.eval_curve(name)}
        return float(points.get(step, math.nan))
    return run.score if metric is None else run.eval_value(metric)


def cell_key(run: RunResult, varying: tuple[str, ...] = ()) -> str:
    """'ALGORITHM:N', with a grid's extra axes and then the `varying` flags after the name:
    'ALGORITHM,flag=value:N'."""
    extra = {**run.axes, **{k: run.flags.get(k) for k in varying if k not in run.axes}}
    return "".join([run.algorithm] + [f",{k}={v}" for k, v in extra.items()]) + f":{run.knob_value}"


def varying_flags(runs: list[RunResult], by: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Algorithm -> those of the flags `by` whose value differs among its runs (or that some of them lack)."""
    groups: dict[str, list[RunResult]] = {}
    for run in runs:
        groups.setdefault(run.algorithm, []).append(run)
    return {algorithm: tuple(k for k in by if len({repr(r.flags.get(k)) for r in group}) > 1)
            for algorithm, group in groups.items()}


def pool_runs(dirs: list[str], by: tuple[str, ...] = ()) -> dict[str, dict[int, RunResult]]:
    """'ALGORITHM:N' -> {seed: run} over the finished runs of every directory (cells split by the flags `by`)."""
    pooled: dict[str, dict[int, RunResult]] = {}
    loaded = []
    for d in dirs:
        runs, _ = load_runs(d)
        if not runs:
            raise SystemExit(f"{d}: no finished runs (neither run directories nor runs.jsonl)")
        loaded.append((d, runs))
    varying = varying_flags([run for _, runs in loaded for run in runs], tuple(by))
    for d, runs in loaded:
        for run in runs:
            key = cell_key(run, varying.get(run.algorithm, ()))
            seeds = pooled.setdefault(key, {})
            if run.seed in seeds:
                raise SystemExit(f"{d}: cell {key} seed {run.seed} is also in an earlier directory; each seed counts "
                                 f"once (if the directories ran it at different settings, name the flag: --by FLAG)")
            seeds[run.seed] = run
    return pooled


def cell_values(pooled: dict[str, dict[int, RunResult]], metric: str | None = None,
                step: int | None = None) -> dict[str, dict[int, float]]:
    """'ALGORITHM:N' -> {seed: value}, runs without the value left out."""
    cells: dict[str, dict[int, float]] = {}
    for key, runs in pooled.items():
        values = {seed: run_value(run, metric, step) for seed, run in runs.items()}
        cells[key] = {seed: v for seed, v in values.items() if not math.isnan(v)}
    return cells


def pool_cells(dirs: list[str], metric: str | None = None, step: int | None = None,
               by: tuple[str, ...] = ()) -> dict[str, dict[int, float]]:
    """'ALGORITHM:N' -> {seed: value} over the finished runs of every directory (cells split by the flags `by`)."""
    return cell_values(pool_runs(dirs, by), metric, step)


def mixed_initial_policies(pooled: dict[str, dict[int, RunResult]]) -> list[str]:
    """A line for each cell whose seeds started from more than one recorded initial policy (run_summary.json's
    `initial_policy`, see async_rlhf/trainers/provenance.py): such a cell pools two experiments."""
    lines = []
    for key, runs in pooled.items():
        by_policy: dict[str, list[int]] = {}
        for seed in sorted(runs):
            by_policy.setdefault(runs[seed].initial_policy or "unrecorded", []).append(seed)
        if len([p for p in by_policy if p != "unrecorded"]) > 1:
            parts = "; ".join(f"{p[:12]}: seeds {' '.join(map(str, s))}" for p, s in by_policy.items())
            lines.append(f"note: cell {key} pools runs from {len(by_policy)} initial policies ({parts})")
    return lines


def mean_interval(values: list[float]) -> Estimate:
    """The mean with its t-interval: the one-cell contrast (Welch-Satterthwaite's df is then n - 1)."""
    if len(values) < 2:
        return Estimate(sum(values) / len(values), math.nan, math.nan, 0)
    return contrast([(1.0, values)])


def contrast(terms: list[tuple[float, list[float]]]) -> Estimate:
    """sum(sign x mean) over (sign, values) terms, with its Welch-Satterthwaite 95% interval."""
    value, pieces = 0.0, []
    for sign, values in terms:
        n = len(values)
        if n < 2:
            raise SystemExit(f"a contrast needs at least 2 seeds in each cell, got {n}")
        mean = sum(values) / n
        value += sign * mean
        pieces.append((sum((v - mean) ** 2 for v in values) / (n - 1) / n, n))
    se2 = sum(p for p, _ in pieces)
    if se2 == 0:
        return Estimate(value, value, value, math.inf)
    df = se2 ** 2 / sum(p ** 2 / (n - 1) for p, n in pieces)
    half = stats.t.ppf(0.975, df) * math.sqrt(se2)
    return Estimate(value, value - half, value + half, df)


def parse_contrast(text: str) -> list[tuple[float, str]]:
    """'a:16 - a:1' -> [(+1, 'a:16'), (-1, 'a:1')]."""
    terms, pos = [], 0
    while pos < len(text):
        m = TERM.match(text, pos)
        if not m or m.end() == pos:
            raise SystemExit(f"--contrast {text!r}: expected terms like 'ALGORITHM:N - ALGORITHM:N' at {text[pos:]!r}")
        terms.append((-1.0 if m.group(1) == "-" else 1.0, f"{m.group(2)}:{m.group(3)}"))
        pos = m.end()
    if not terms:
        raise SystemExit("--contrast: empty")
    return terms


def default_contrasts(cells: dict[str, dict[int, float]]) -> list[str]:
    """Each algorithm's every N against its N = 1."""
    out = []
    for key in cells:
        algorithm, n = key.rsplit(":", 1)
        if n != "1" and f"{algorithm}:1" in cells:
            out.append(f"{key} - {algorithm}:1")
    return out


def signed(e: Estimate) -> str:
    return f"{e.value:+.3f} [{e.low:+.3f}, {e.high:+.3f}]"


def report(cells: dict[str, dict[int, float]], contrasts: list[str]) -> list[str]:
    lines = ["| cell | seeds | values | mean [95% t] |", "| --- | --- | --- | --- |"]
    for key, seeds in cells.items():
        values = [seeds[s] for s in sorted(seeds)]
        e = mean_interval(values)
        lines.append(f"| {key} | {' '.join(map(str, sorted(seeds)))} | {', '.join(f'{v:.3f}' for v in values)} "
                     f"| {e.value:.3f} [{e.low:.3f}, {e.high:.3f}] |")
    if contrasts:
        lines += ["", "| contrast | difference [Welch 95%] | df |", "| --- | --- | --- |"]
    for text in contrasts:
        terms = parse_contrast(text)
        missing = [k for _, k in terms if k not in cells]
        if missing:
            raise SystemExit(f"--contrast {text!r}: no cell {', '.join(missing)} (cells: {', '.join(cells)})")
        few = [k for _, k in terms if len(cells[k]) < 2]
        if few:  # no interval from one seed (a --quick sweep): said in its row, the other rows still computed
            value = sum(sign * sum(cells[k].values()) / len(cells[k]) for sign, k in terms)
            lines.append(f"| {text} | {value:+.3f}, no interval: "
                         f"{', '.join(f'{k} has {len(cells[k])} seed' for k in few)}, an interval needs 2 | |")
            continue
        e = contrast([(sign, list(cells[k].values())) for sign, k in terms])
        lines.append(f"| {text} | {signed(e)} | {e.df:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", help="sweep output directories or committed results (runs.jsonl)")
    parser.add_argument("--metric", default=None, help="evaluation metric (default: the run's score)")
    parser.add_argument("--step", type=int, default=None, help="the evaluation logged at this training step")
    parser.add_argument("--by", action="append", default=None, metavar="FLAG",
                        help="split cells by this recipe flag where its value differs, e.g. learning_rate (repeat)")
    parser.add_argument("--contrast", action="append", default=None,
                        help="signed cells, e.g. 'ppo_none:16 - ppo_none:1' (repeat for more)")
    args = parser.parse_args(argv)
    pooled = pool_runs(args.dirs, tuple(args.by or ()))
    cells = cell_values(pooled, args.metric, args.step)
    lines = report(cells, args.contrast if args.contrast is not None else default_contrasts(cells))
    notes = mixed_initial_policies(pooled)
    lines += [""] + notes if notes else []
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main(sys.argv[1:])
