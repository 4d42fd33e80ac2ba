"""One run's numbers, from its raw record (evals/archive.py): the score, KL, wall time, throughput, staleness and
the curves through training that the table and the plots need.

Score, per run:
- with a gold evaluation (the built-in task): `gold_win_rate` of eval_results.json; the curves over steps and time
  use the evaluations logged during training (`eval/<name>` or `eval_<name>` keys in metrics.jsonl) plus the
  final one;
- without one (toy, hub): the training reward `objective/scores` (a policy-sampled batch scored by the training
  reward), averaged over the last 10% of logged steps (at least one) because one batch is noisy. KL likewise: the
  evaluation's `kl` to the SFT model, else the training `objective/kl` averaged the same way.
A run is finished when it has its run_summary.json, and its eval_results.json when the task evaluates: the
sweep's definition too (`run_finished`), so the sweep and the table never disagree about which runs count.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from evals.archive import load_records
from evals.labels import GOLD_KL, GOLD_SCORE, TRAIN_KL, TRAIN_SCORE

EVAL_NAMES = ("gold_win_rate", "gold_reward", "kl", "sft_perplexity", "seconds")  # evaluation metrics we read
EVAL_PREFIXES = ("eval/", "eval_")  # how evaluations during training are named in metrics.jsonl
TAIL_FRACTION = 0.1  # the fallback score averages the last 10% of logged training steps


def run_finished(run_dir: str, expects_eval: bool) -> bool:
    """The sweep's definition of a finished run: its summary, and its final evaluation when the task has one."""
    return os.path.isfile(os.path.join(run_dir, "run_summary.json")) and (
        not expects_eval or os.path.isfile(os.path.join(run_dir, "eval_results.json")))


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
    flags: dict = field(default_factory=dict)  # the recipe flags the sweep gave it (its sweep_run.json)

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

    @property
    def initial_policy(self) -> str | None:
        """The fingerprint of the weights the run started from (run_summary.json's `initial_policy`: a SHA-256, or
        a hub snapshot commit); None for a record made before runs kept it, or an in-memory model."""
        record = self.summary.get("initial_policy") or {}
        return record.get("sha256") or record.get("commit")

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
    def eval_seconds_in_summary_loop(self) -> float:
        """Of those, the seconds the summary's `loop_seconds` still holds: none once the summary reports
        `eval_seconds` (its loop is net of them), all of them in the summaries of earlier runs."""
        return 0.0 if "eval_seconds" in self.summary else self.eval_seconds_in_loop

    @property
    def wall_seconds(self) -> float:
        """The recipe's `train()` wall time, generator start-up and training loop, less the gold evaluations during
        training (not imports, not the final evaluation either): what sync vs async compares."""
        return float(self.summary.get("wall_seconds", math.nan)) - self.eval_seconds_in_loop

    @property
    def samples_per_s(self) -> float:
        """Training-loop throughput: samples / loop seconds (generator start-up and evaluations excluded)."""
        loop = (self.summary.get("loop_seconds") or 0.0) - self.eval_seconds_in_summary_loop
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


def _split_metrics(lines: list) -> tuple[list[dict], list[dict]]:
    """(training lines, evaluation lines) of a run's parsed metrics.jsonl, each in step order."""
    steps, evals = [], []
    for line in lines:
        if not isinstance(line, dict) or "step" not in line:
            continue
        if TRAIN_SCORE in line:
            steps.append(line)
        found = eval_metrics(line)
        if found:
            evals.append({"step": line["step"], **({"elapsed_seconds": line["elapsed_seconds"]}
                                                   if "elapsed_seconds" in line else {}), **found})
    return sorted(steps, key=lambda m: m["step"]), sorted(evals, key=lambda m: m["step"])


def run_from_record(raw: dict) -> RunResult | dict:
    """A finished run's RunResult, or for an unfinished one the dict the table lists it by (its sweep_run.json, or
    name and status when that is unreadable)."""
    files, unreadable = raw.get("files", {}), raw.get("unreadable", {})
    if "sweep_run.json" in unreadable or "sweep_run.json" not in files:
        return {"name": raw["name"], "status": f"unreadable sweep_run.json: {unreadable.get('sweep_run.json')}"}
    record = files["sweep_run.json"]
    for name in ("run_summary.json", "eval_results.json"):
        if name in unreadable:
            return {**record, "status": f"unreadable {name}: {unreadable[name]}"}
    if "run_summary.json" not in files or (record.get("expects_eval", False) and "eval_results.json" not in files):
        return record
    steps, evals = _split_metrics(files.get("metrics.jsonl", []))
    seconds = record.get("seconds")
    return RunResult(
        name=record["name"], algorithm=record["algorithm"], knob=record["knob"],
        knob_value=int(record["knob_value"]), seed=int(record["seed"]), axes=record.get("axes") or {},
        summary=files["run_summary.json"], eval=files.get("eval_results.json"),
        steps=steps, evals=evals, process_seconds=float(seconds) if seconds is not None else math.nan,
        index=int(record.get("index", 0)), flags=record.get("flags") or {},
    )


def load_runs(output_dir: str) -> tuple[list[RunResult], list[dict]]:
    """(finished runs, records of the unfinished ones) of a sweep, in name order: from output_dir/runs/*/, else
    from output_dir/runs.jsonl (see evals/archive.py)."""
    finished, unfinished = [], []
    for raw in load_records(output_dir):
        run = run_from_record(raw)
        (finished if isinstance(run, RunResult) else unfinished).append(run)
    return finished, unfinished
