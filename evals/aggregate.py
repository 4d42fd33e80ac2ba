"""A sweep's results, from its run directories alone: one table (markdown and CSV) and the plots.

    python evals/aggregate.py outputs/paper_ablation      # writes results.md, results.csv and plots/*.png there

Reads `DIR/runs/*/` as launch/sweep.py leaves them: `sweep_run.json` (the cell: algorithm, knob and its value,
extra axes, seed; the run's total seconds), `run_summary.json` (wall and loop seconds, samples, staleness
histogram, dropped batches), `metrics.jsonl` (one line per logged step: training metrics, and evaluation metrics
at eval steps) and, when the task evaluates, `eval_results.json` (the final gold evaluation). A cell is
{algorithm} x {knob value} x {extra axes}; its numbers are the mean and the sample standard deviation (ddof 1)
over the seeds that finished (no std for a single seed). Unfinished runs are left out and listed under the table.

Score, per run:
- with a gold evaluation (the built-in task): `gold_win_rate` of eval_results.json; the curves over steps and time
  use the evaluations logged during training (`eval/<name>` or `eval_<name>` keys in metrics.jsonl) plus the
  final one;
- without one (toy, hub): the training reward `objective/scores` (a policy-sampled batch scored by the training
  reward), averaged over the last 10% of logged steps (at least one) because one batch is noisy; the table and
  the plots say so. KL likewise: the evaluation's `kl` to the SFT model, else the training `objective/kl`
  averaged the same way.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import sys
from dataclasses import dataclass, field

GOLD_SCORE, TRAIN_SCORE = "gold_win_rate", "objective/scores"
GOLD_KL, TRAIN_KL = "kl", "objective/kl"
EVAL_NAMES = ("gold_win_rate", "gold_reward", "kl", "sft_perplexity", "seconds")  # evaluation metrics we read
EVAL_PREFIXES = ("eval/", "eval_")  # how evaluations during training are named in metrics.jsonl
EXTRA_EVAL_NAMES = ("gold_reward", "sft_perplexity")  # extra table columns, when every run of a cell has them
TAIL_FRACTION = 0.1  # the fallback score averages the last 10% of logged training steps
KNOB_LETTERS = {"num_mini_batches": "N", "max_staleness": "S"}
SCORE_LABELS = {GOLD_SCORE: "gold win-rate", TRAIN_SCORE: "training reward (objective/scores)"}
KL_LABELS = {GOLD_KL: "KL to SFT (eval)", TRAIN_KL: "KL (training objective/kl)"}
FALLBACK_NOTE = ("no gold evaluation for this task: the training reward objective/scores (mean of the last 10% of "
                 "logged steps) stands in for the gold win-rate, and KL is the training objective/kl")


def run_finished(run_dir: str, expects_eval: bool) -> bool:
    """The sweep's definition of a finished run: its summary, and its final evaluation when the task has one."""
    return os.path.isfile(os.path.join(run_dir, "run_summary.json")) and (
        not expects_eval or os.path.isfile(os.path.join(run_dir, "eval_results.json")))


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1); std is nan for fewer than two values, mean nan for none."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))


def eval_metrics(line: dict) -> dict[str, float]:
    """The evaluation metrics of one metrics.jsonl line, by plain name (`eval/kl` and `eval_kl` both give `kl`)."""
    out = {}
    for key, value in line.items():
        for prefix in EVAL_PREFIXES:
            if key.startswith(prefix) and key[len(prefix):] in EVAL_NAMES and isinstance(value, (int, float)):
                out[key[len(prefix):]] = float(value)
    return out


@dataclass
class RunResult:
    """One finished run: its cell, what the recipe wrote, and the numbers the table needs."""

    name: str
    algorithm: str
    knob: str
    knob_value: int
    seed: int
    axes: dict
    summary: dict  # run_summary.json
    eval: dict | None  # eval_results.json
    steps: list[dict]  # metrics.jsonl lines of training steps (those with objective/scores), in step order
    evals: list[dict] = field(default_factory=list)  # {"step", "elapsed"?, <eval name>: value} logged in training
    process_seconds: float = math.nan  # the whole recipe process (start-up, training, save, final evaluation)
    index: int = 0  # position of the run in its grid (tables and plots follow the grid's order)

    @property
    def evaluated(self) -> bool:
        return bool(self.eval) and GOLD_SCORE in self.eval

    @property
    def score_source(self) -> str:
        return GOLD_SCORE if self.evaluated else TRAIN_SCORE

    @property
    def score(self) -> float:
        return float(self.eval[GOLD_SCORE]) if self.evaluated else self._tail_mean(TRAIN_SCORE)

    @property
    def kl_source(self) -> str:
        return GOLD_KL if self.eval and GOLD_KL in self.eval else TRAIN_KL

    @property
    def kl(self) -> float:
        return float(self.eval[GOLD_KL]) if self.kl_source == GOLD_KL else self._tail_mean(TRAIN_KL)

    def eval_value(self, name: str) -> float:
        return float(self.eval[name]) if self.eval and name in self.eval else math.nan

    def _tail_mean(self, key: str) -> float:
        values = [float(s[key]) for s in self.steps if key in s]
        if not values:  # no metrics.jsonl: the summary's last logged value
            final = (self.summary.get("final") or {}).get(key)
            return float(final) if final is not None else math.nan
        tail = values[-max(1, math.ceil(TAIL_FRACTION * len(values))):]
        return sum(tail) / len(tail)

    @property
    def eval_seconds_in_loop(self) -> float:
        """Seconds the gold evaluations during training took (`eval/seconds`), inside the training loop."""
        return sum(e.get("seconds", 0.0) for e in self.evals)

    @property
    def wall_seconds(self) -> float:
        """The recipe's `train()` wall time, generator start-up and training loop, less the gold evaluations during
        training (not imports, not the final evaluation either): what sync vs async compares."""
        return float(self.summary.get("wall_seconds", math.nan)) - self.eval_seconds_in_loop

    @property
    def samples_per_s(self) -> float:
        """Training-loop throughput: samples / loop seconds (generator start-up and evaluations excluded)."""
        loop = (self.summary.get("loop_seconds") or 0.0) - self.eval_seconds_in_loop
        return self.summary.get("samples", 0) / loop if loop > 0 else math.nan

    @property
    def staleness_histogram(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in (self.summary.get("staleness_histogram") or {}).items()}

    @property
    def dropped_samples(self) -> float:
        """run_summary counts dropped batches; a batch is samples / steps samples."""
        steps = self.summary.get("steps") or 0
        per_batch = self.summary.get("samples", 0) / steps if steps else 0.0
        return self.summary.get("dropped", 0) * per_batch

    @property
    def synchronous(self) -> bool:
        return (self.knob == "num_mini_batches" and self.knob_value == 1) or (
            self.knob == "max_staleness" and self.knob_value == 0)

    def elapsed(self, line: dict) -> float:
        """Seconds since `train()` began at which a metrics line was logged: its own `elapsed_seconds` when the
        trainer writes one, else estimated as generator start-up + step x (loop seconds / steps)."""
        if isinstance(line.get("elapsed_seconds"), (int, float)):
            return float(line["elapsed_seconds"])
        steps = self.summary.get("steps") or 1
        per_step = (self.summary.get("loop_seconds") or 0.0) / steps
        return (self.summary.get("generator_start_seconds") or 0.0) + line["step"] * per_step

    @property
    def timed(self) -> bool:
        """Whether metrics.jsonl carries real timestamps (else `elapsed` estimates them)."""
        return bool(self.steps) and all("elapsed_seconds" in s for s in self.steps)

    def score_curve(self) -> list[tuple[int, float, float]]:
        """(step, elapsed seconds, score) through the run: the gold evaluations (during training, then the final
        one) when the task evaluates, else the training reward of every logged step."""
        if not self.evaluated:
            return [(s["step"], self.elapsed(s), float(s[TRAIN_SCORE])) for s in self.steps]
        return self.eval_curve(GOLD_SCORE)

    def eval_curve(self, name: str) -> list[tuple[int, float, float]]:
        """(step, elapsed seconds, value) of one evaluation metric: the evaluations logged during training, then
        the final one (empty when the run has no final evaluation of it)."""
        if not self.eval or name not in self.eval:
            return []
        points = {e["step"]: (e["step"], self.elapsed(e), e[name]) for e in self.evals if name in e}
        final_step = int(self.summary.get("steps") or max(points, default=0))
        wall = float(self.summary.get("wall_seconds", math.nan))  # raw elapsed time, like `elapsed`
        points[final_step] = (final_step, wall, float(self.eval[name]))  # the final evaluation
        return [points[k] for k in sorted(points)]


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def _read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of a metrics.jsonl; a torn last line (killed run) is ignored."""
    steps, evals = [], []
    if not os.path.isfile(path):
        return steps, evals
    with open(path) as f:
        for text in f:
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if not isinstance(line, dict) or "step" not in line:
                continue
            if TRAIN_SCORE in line:
                steps.append(line)
            found = eval_metrics(line)
            if found:
                evals.append({"step": line["step"], **({"elapsed_seconds": line["elapsed_seconds"]}
                                                       if "elapsed_seconds" in line else {}), **found})
    return sorted(steps, key=lambda m: m["step"]), sorted(evals, key=lambda m: m["step"])


def load_runs(output_dir: str) -> tuple[list[RunResult], list[dict]]:
    """(finished runs, records of the unfinished ones) under output_dir/runs/, in name order."""
    finished, unfinished = [], []
    for record_path in sorted(glob.glob(os.path.join(output_dir, "runs", "*", "sweep_run.json"))):
        run_dir = os.path.dirname(record_path)
        try:
            record = _read_json(record_path)
        except (OSError, ValueError) as exc:
            unfinished.append({"name": os.path.basename(run_dir), "status": f"unreadable sweep_run.json: {exc}"})
            continue
        if not run_finished(run_dir, record.get("expects_eval", False)):
            unfinished.append(record)
            continue
        steps, evals = _read_metrics(os.path.join(run_dir, "metrics.jsonl"))
        eval_path = os.path.join(run_dir, "eval_results.json")
        seconds = record.get("seconds")
        finished.append(RunResult(
            name=record["name"], algorithm=record["algorithm"], knob=record["knob"],
            knob_value=int(record["knob_value"]), seed=int(record["seed"]), axes=record.get("axes") or {},
            summary=_read_json(os.path.join(run_dir, "run_summary.json")),
            eval=_read_json(eval_path) if os.path.isfile(eval_path) else None,
            steps=steps, evals=evals, process_seconds=float(seconds) if seconds is not None else math.nan,
            index=int(record.get("index", 0)),
        ))
    return finished, unfinished


@dataclass
class Cell:
    """The runs of one {algorithm} x {knob value} x {extra axes}, over seeds."""

    algorithm: str
    knob: str
    knob_value: int
    axes: tuple  # ((flag, value), ...) in grid order
    runs: list[RunResult] = field(default_factory=list)

    @property
    def series(self) -> str:
        """What a plot draws as one line or panel: the algorithm, plus the extra axes' values."""
        return " ".join([self.algorithm] + [f"{k}={v}" for k, v in self.axes])

    @property
    def knob_label(self) -> str:
        return f"{KNOB_LETTERS.get(self.knob, self.knob)}={self.knob_value}"

    @property
    def synchronous(self) -> bool:
        return self.runs[0].synchronous

    def stat(self, attr: str) -> tuple[float, float]:
        return mean_std([getattr(r, attr) for r in self.runs])

    def source(self, attr: str) -> str:
        sources = {getattr(r, attr) for r in self.runs}
        return sources.pop() if len(sources) == 1 else "mixed"

    @property
    def staleness_histogram(self) -> dict[int, int]:
        """Trained batches per staleness, summed over seeds."""
        total: dict[int, int] = {}
        for r in self.runs:
            for k, v in r.staleness_histogram.items():
                total[k] = total.get(k, 0) + v
        return dict(sorted(total.items()))

    @property
    def staleness_mean(self) -> float:
        hist = self.staleness_histogram
        count = sum(hist.values())
        return sum(k * v for k, v in hist.items()) / count if count else math.nan

    @property
    def staleness_max(self) -> int | None:
        seen = [k for k, v in self.staleness_histogram.items() if v > 0]
        return max(seen) if seen else None

    @property
    def staleness_bound(self) -> int:
        return max(int(r.summary.get("max_staleness", 0)) for r in self.runs)

    def curve(self, eval_name: str | None = None) -> tuple[list[float], list[float], list[float], list[float]]:
        """(steps, elapsed seconds, mean, std) over the seeds, at every step all seeds logged: of the score, or of
        the evaluation metric `eval_name` (e.g. "kl") when given."""
        by_step: dict[int, list[tuple[float, float]]] = {}
        for r in self.runs:
            for step, elapsed, score in (r.eval_curve(eval_name) if eval_name else r.score_curve()):
                by_step.setdefault(step, []).append((elapsed, score))
        steps, times, means, stds = [], [], [], []
        for step in sorted(by_step):
            if len(by_step[step]) < len(self.runs):  # a seed without this step would bias the mean
                continue
            mean, std = mean_std([s for _, s in by_step[step]])
            steps.append(step)
            times.append(mean_std([t for t, _ in by_step[step]])[0])
            means.append(mean)
            stds.append(0.0 if math.isnan(std) else std)
        return steps, times, means, stds

    def win_rate_kl_path(self) -> list[tuple[int, float, float, float]]:
        """(step, mean gold win-rate, its std over seeds, mean KL) at every evaluation that all seeds logged, with
        both numbers. Empty without gold evaluations: a path of the noisy training reward would mean nothing."""
        if self.source("score_source") != GOLD_SCORE:
            return []
        steps, _, means, stds = self.curve()
        kl_steps, _, kls, _ = self.curve(GOLD_KL)
        kl_at = dict(zip(kl_steps, kls))
        return [(s, m, sd, kl_at[s]) for s, m, sd in zip(steps, means, stds) if s in kl_at]

    def peak(self) -> tuple[float, float, int | None, float]:
        """The best point of the seed-mean gold win-rate path: (mean, std over seeds, step, mean KL there); all
        nan (step None) without gold evaluations. It is picked on the same prompts it is measured on, so it
        flatters a little; the final score does not."""
        path = self.win_rate_kl_path()
        if not path:
            return math.nan, math.nan, None, math.nan
        step, mean, std, kl = max(path, key=lambda p: p[1])
        return mean, (std if len(self.runs) > 1 else math.nan), step, kl


def group_cells(runs: list[RunResult]) -> list[Cell]:
    cells: dict[tuple, Cell] = {}
    for r in runs:
        key = (r.algorithm, r.knob, r.knob_value, tuple(r.axes.items()))
        cells.setdefault(key, Cell(r.algorithm, r.knob, r.knob_value, tuple(r.axes.items()))).runs.append(r)
    for cell in cells.values():
        cell.runs.sort(key=lambda r: r.seed)
    # the grid's order (sweep_run.json's `index`), else by name
    return sorted(cells.values(), key=lambda c: (min(r.index for r in c.runs), c.algorithm, c.knob,
                                                 tuple(map(repr, c.axes)), c.knob_value))


def table_rows(cells: list[Cell]) -> list[dict]:
    """One row per cell, numbers unrounded (the CSV); `write_markdown` formats the same rows."""
    axis_names = list(dict.fromkeys(k for c in cells for k, _ in c.axes))
    extra = [k for k in EXTRA_EVAL_NAMES if any(r.eval and k in r.eval for c in cells for r in c.runs)]
    rows = []
    for c in cells:
        row = {"algorithm": c.algorithm, "knob": c.knob, "knob_value": c.knob_value}
        row.update({f"axis:{k}": dict(c.axes).get(k, "") for k in axis_names})
        row["seeds"] = " ".join(str(r.seed) for r in c.runs)
        row["n_seeds"] = len(c.runs)
        row["score_source"] = c.source("score_source")
        row["score_mean"], row["score_std"] = c.stat("score")
        row["kl_source"] = c.source("kl_source")
        row["kl_mean"], row["kl_std"] = c.stat("kl")
        row["peak_score_mean"], row["peak_score_std"], row["peak_step"], row["peak_kl_mean"] = c.peak()
        for k in extra:
            values = [r.eval_value(k) for r in c.runs]
            row[f"{k}_mean"], row[f"{k}_std"] = (mean_std(values) if not any(map(math.isnan, values))
                                                 else (math.nan, math.nan))
        row["wall_seconds_mean"], row["wall_seconds_std"] = c.stat("wall_seconds")
        row["process_seconds_mean"], row["process_seconds_std"] = c.stat("process_seconds")
        row["samples_per_s_mean"], row["samples_per_s_std"] = c.stat("samples_per_s")
        row["staleness_bound"] = c.staleness_bound
        row["staleness_mean"] = c.staleness_mean
        row["staleness_max"] = c.staleness_max
        row["dropped_samples_mean"] = c.stat("dropped_samples")[0]
        row["dropped_batches_total"] = sum(int(r.summary.get("dropped", 0)) for r in c.runs)
        rows.append(row)
    return rows


def write_csv(rows: list[dict], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()})


def _fmt(mean, std: float = math.nan, digits: int = 3) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    text = f"{mean:.{digits}g}"
    return text if math.isnan(std) else f"{text} ± {std:.2g}"


def score_label(rows_or_cells) -> str:
    """The score's name for headers and axes, with † when it is (partly) the training-reward fallback."""
    sources = {r["score_source"] if isinstance(r, dict) else r.source("score_source") for r in rows_or_cells}
    if sources == {GOLD_SCORE}:
        return SCORE_LABELS[GOLD_SCORE]
    if sources == {TRAIN_SCORE}:
        return SCORE_LABELS[TRAIN_SCORE] + " †"
    return "gold win-rate where evaluated, else training reward †"


def kl_label(rows_or_cells) -> str:
    sources = {r["kl_source"] if isinstance(r, dict) else r.source("kl_source") for r in rows_or_cells}
    source = sources.pop() if len(sources) == 1 else "mixed"
    return KL_LABELS.get(source, "KL (eval where evaluated, else training objective/kl)")


def write_markdown(rows: list[dict], unfinished: list[dict], path: str, plots: list[str], description: str = "",
                   command: str = "") -> None:
    axis_names = [k[len("axis:"):] for k in rows[0] if k.startswith("axis:")]
    extra = [k for k in EXTRA_EVAL_NAMES if f"{k}_mean" in rows[0]]
    peaks = any(r["peak_step"] is not None for r in rows)
    header = (["algorithm", "knob"] + axis_names + ["seeds", score_label(rows), kl_label(rows)]
              + (["peak win-rate (step, KL)"] if peaks else []) + [k.replace("_", " ") for k in extra]
              + ["train wall s", "samples/s", "staleness mean", "staleness max (bound)", "dropped samples/run"])
    lines = ["# Sweep results", ""]
    if description:
        lines += [description, ""]
    if command:
        lines += ["Made by:", "", "```bash", command, "```", ""]
    lines += ["Mean ± sample std (ddof 1) over the seeds that finished. *Train wall s*: the recipe's `train()` time "
              "(generator start-up and training loop; not imports, not the gold evaluations during training or at "
              "the end); *samples/s*: samples / training-loop seconds (evaluations excluded). *Staleness*: optimizer "
              "steps between the policy that sampled a batch and the policy it trained, over every trained batch of "
              "every seed; the bound is max_staleness. *Dropped*: samples discarded for exceeding the bound (and "
              "regenerated)." + (" *Peak win-rate*: the best point of the seed-mean win-rate curve over the "
                                 "evaluations during training and the final one, with its step and mean KL; "
                                 "picked on the evaluation prompts themselves, so it flatters a little (the final "
                                 "win-rate does not), and where it comes well before the end the proxy reward was "
                                 "over-optimised." if peaks else ""), "",
              "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        knob = f"{KNOB_LETTERS.get(r['knob'], r['knob'])}={r['knob_value']}"
        cells = [r["algorithm"], knob] + [str(r[f"axis:{a}"]) for a in axis_names] + [str(r["n_seeds"])]
        cells += [_fmt(r["score_mean"], r["score_std"]), _fmt(r["kl_mean"], r["kl_std"])]
        if peaks:
            cells.append("–" if r["peak_step"] is None else
                         f"{_fmt(r['peak_score_mean'], r['peak_score_std'])} ({r['peak_step']}, "
                         f"{_fmt(r['peak_kl_mean'], digits=2)})")
        cells += [_fmt(r[f"{k}_mean"], r[f"{k}_std"]) for k in extra]
        cells += [_fmt(r["wall_seconds_mean"], r["wall_seconds_std"]),
                  _fmt(r["samples_per_s_mean"], r["samples_per_s_std"]), _fmt(r["staleness_mean"], digits=2),
                  ("–" if r["staleness_max"] is None else str(r["staleness_max"])) + f" ({r['staleness_bound']})",
                  _fmt(r["dropped_samples_mean"])]
        lines.append("| " + " | ".join(cells) + " |")
    if "†" in score_label(rows):
        lines += ["", "† No gold evaluation for (some of) these runs (toy and hub tasks write no eval_results.json): "
                  "the score is the training reward `objective/scores` (a policy-sampled training batch scored by the "
                  "training reward, mean of the last 10% of logged steps), not a gold win-rate, and KL is the training "
                  "`objective/kl` averaged the same way. Column `score_source` of results.csv says which per cell."]
    if unfinished:
        lines += ["", f"Not in the table ({len(unfinished)} unfinished run(s)):", ""]
        lines += [f"- `{u.get('name')}`: {u.get('status')}" + (f" — {u['message']}" if u.get("message") else "")
                  for u in unfinished]
    if plots:
        rel = os.path.dirname(path)
        lines += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.relpath(p, rel)})" for p in plots]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


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
        report = _read_json(report_path)
        description, command = report.get("description", ""), report.get("command", "")
    written = []
    if plots:
        from evals.plots import draw_all

        written = draw_all(cells, os.path.join(output_dir, "plots"))
    csv_path, md_path = os.path.join(output_dir, "results.csv"), os.path.join(output_dir, "results.md")
    write_csv(rows, csv_path)
    write_markdown(rows, unfinished, md_path, written, description, command)
    return [md_path, csv_path] + written


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Table (results.md, results.csv) and plots (plots/*.png) of a sweep.")
    parser.add_argument("output_dir", help="the --output_dir of launch/sweep.py")
    parser.add_argument("--no_plots", action="store_true")
    args = parser.parse_args(argv)
    written = aggregate(args.output_dir, plots=not args.no_plots)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:  # `python evals/aggregate.py` from a checkout
        sys.path.insert(0, root)
    sys.exit(main(sys.argv[1:]))
