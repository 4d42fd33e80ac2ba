"""The sweep's table: one row per cell, unrounded in results.csv, formatted in results.md (mean ± std over seeds,
the score's source in the header, unfinished runs listed under the table, links to the plots)."""

from __future__ import annotations

import csv
import math
import os

from evals.cells import Cell, mean_std
from evals.labels import KNOB_LETTERS, kl_label, score_label

EXTRA_EVAL_NAMES = ("gold_reward", "sft_perplexity")  # extra table columns, when every run of a cell has them


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
