"""Runs grouped into cells ({algorithm} x {knob value} x {extra axes}) with their statistics over seeds: mean and
sample standard deviation (ddof 1), curves at the steps every seed logged, the pooled staleness histogram and the
peak of the gold win-rate path. What the table (evals/table.py) and the plots (evals/plots.py) both draw from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from evals.labels import GOLD_KL, GOLD_SCORE, KNOB_LETTERS
from evals.run_result import RunResult


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
    # the grid's order of algorithms and of extra axes (sweep_run.json's `index`: a grid grown later keeps its first
    # runs' indices), then each algorithm's cells by knob value
    first: dict[tuple, int] = {}
    for cell in cells.values():
        low = min(r.index for r in cell.runs)
        for key in ((cell.algorithm,), (cell.algorithm, cell.axes)):
            first[key] = min(first.get(key, low), low)
    return sorted(cells.values(), key=lambda c: (first[c.algorithm,], c.algorithm, first[c.algorithm, c.axes], c.knob,
                                                 _value_key(c.knob_value)))


def _value_key(value) -> tuple:
    """Numbers in numeric order before anything else (in text order)."""
    return (0, value, "") if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, 0, repr(value))

