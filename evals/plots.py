"""The sweep's plots (matplotlib, PNG), drawn from the cells of evals/cells.py. One function per figure:

- `winrate_vs_kl.png`: final score against KL, one point per knob value (N or S), one line per algorithm: the
  paper's Pareto view (does going more off-policy cost reward, KL, or both?);
- `score_vs_knob.png`: the paper's ablation view: final score against the knob (N or S, log scale), one line per
  algorithm, error bars one std over seeds; a second panel the same for the gold reward where every run has one,
  with the SFT policy's gold reward as a dashed line where every run's evaluation carries it (`sft_gold_reward`,
  written when the task evaluates the SFT policy's completions too) or a baseline record gives it (`sft`, below);
- `winrate_vs_wallclock.png`: left, final score against the run's training wall time, synchronous cells (N=1 / S=0)
  hollow squares, asynchronous ones filled circles (what asynchrony saves, and at what score); right, the score
  during the run against elapsed time, one line per cell, synchronous dashed;
- `winrate_over_steps.png`: the score over optimizer steps, one panel per algorithm, one line per knob value, and a
  second row of the gold reward where every run's evaluations have it; the SFT policy's value dashed where known;
- `winrate_vs_kl_over_training.png`: the gold win-rate against KL at every evaluation of the run, one panel per
  algorithm, one line per knob value: the path each setting takes away from the SFT policy, where over-optimising
  the proxy shows as a line that turns down while KL keeps growing (gold evaluations only);
- `staleness_histograms.png`: how stale the trained batches really were, per algorithm and knob value, summed
  over seeds, with the bound.

"Score" is the gold win-rate when the task evaluates (curves: the evaluations logged during training plus the
final one), else the training reward objective/scores; every figure says which. All curves are mean ± std over
seeds. metrics.jsonl lines without an `elapsed_seconds` field are placed in time by uniform step time, which the
figure states. A figure with nothing to draw is still written, with a note saying why, so a run of the harness
always yields the same files.

`sft`, where given, is the SFT policy's own evaluation, evaluated as the runs are (`{metric: value}`, e.g.
`gold_reward`, `gold_win_rate`: evals/sorting_sft_baseline.py writes one), for tasks whose runs do not carry it.
"""

from __future__ import annotations

import functools
import math
import os

from evals.cells import mean_std
from evals.labels import FALLBACK_NOTE, kl_label, score_label

FILES = ("winrate_vs_kl.png", "score_vs_knob.png", "winrate_vs_wallclock.png", "winrate_over_steps.png",
         "winrate_vs_kl_over_training.png", "staleness_histograms.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def _by_series(cells) -> dict[str, list]:
    out: dict[str, list] = {}
    for c in cells:
        out.setdefault(c.series, []).append(c)
    for cs in out.values():
        cs.sort(key=lambda c: c.knob_value)
    return out


def _nan0(x: float) -> float:
    return 0.0 if x is None or math.isnan(x) else x


def _notes(cells, time_axis: bool = False) -> list[str]:
    notes = []
    if "†" in score_label(cells):
        notes.append(FALLBACK_NOTE)
    if time_axis and not all(r.timed for c in cells for r in c.runs if not r.evaluated):
        notes.append("elapsed time estimated as generator start-up + step x (loop seconds / steps)")
    return notes


def _save(fig, path: str, notes: list[str]) -> str:
    text = "\n".join(n for n in notes if n)
    if text:
        fig.text(0.01, 0.005, text, fontsize=7, color="0.35", ha="left", va="bottom", wrap=True)
    lines = text.count("\n") + 1 if text else 0
    fig.tight_layout(rect=(0, min(0.2, 0.03 * lines), 1, 1))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _panels(plt, n: int, width: float = 4.6, height: float = 3.4, cols: int = 3):
    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows + 0.5), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _knob_colors(plt, cells) -> dict:
    """One colour per knob value, the same in every panel (viridis, low N dark)."""
    values = sorted({c.knob_value for c in cells})
    cmap = plt.get_cmap("viridis")
    return {v: cmap(0.9 * i / max(1, len(values) - 1)) for i, v in enumerate(values)}


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def winrate_vs_kl(cells, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    drawn = 0
    for i, (series, cs) in enumerate(_by_series(cells).items()):
        pts = [(c, *c.stat("kl"), *c.stat("score")) for c in cs]
        pts = [p for p in pts if not (math.isnan(p[1]) or math.isnan(p[3]))]
        if not pts:
            continue
        drawn += 1
        ax.errorbar([p[1] for p in pts], [p[3] for p in pts], xerr=[_nan0(p[2]) for p in pts],
                    yerr=[_nan0(p[4]) for p in pts], marker="o", capsize=3, color=f"C{i}", label=series)
        for c, kl, _, score, _ in pts:
            ax.annotate(c.knob_label, (kl, score), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel(kl_label(cells))
    ax.set_ylabel(score_label(cells).rstrip(" †"))
    ax.set_title("Final score vs KL, one point per off-policy setting\n(mean ± std over seeds; up and left is better)")
    if drawn:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path, _notes(cells) + ([] if drawn else ["no cell has both a finite score and KL"]))


def sft_reference(cells, name: str = "sft_gold_reward") -> float:
    """The SFT policy's value of an evaluation metric, from the runs' final evaluations (`sft_gold_reward`: the gold
    reward of the SFT policy's completions of the same prompts); NaN unless every run has it. Runs of one sweep
    evaluate the same prompts, so the values agree; their mean is drawn."""
    values = [r.eval_value(name) for c in cells for r in c.runs]
    return math.nan if not values or any(map(math.isnan, values)) else sum(values) / len(values)


def _sft_line(ax, cells, sft: dict | None, metric: str) -> None:
    """The SFT policy's value of `metric` as a dashed line: from the runs (`sft_<metric>`), else from `sft`."""
    value = sft_reference(cells, f"sft_{metric}")
    if math.isnan(value) and sft and isinstance(sft.get(metric), (int, float)):
        value = float(sft[metric])
    if not math.isnan(value):
        ax.axhline(value, color="0.4", ls="--", lw=1, label="SFT policy")


def score_vs_knob(cells, path: str, sft: dict | None = None) -> str:
    plt = _pyplot()
    gold_reward = all(not math.isnan(r.eval_value("gold_reward")) for c in cells for r in c.runs)
    panels = [("score", score_label(cells).rstrip(" †"))] + ([("gold_reward", "final gold reward")] if gold_reward
                                                              else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.6), squeeze=False)
    drawn = 0
    for ax, (what, label) in zip(axes[0], panels):
        for i, (series, cs) in enumerate(_by_series(cells).items()):
            pts = []
            for c in sorted(cs, key=lambda c: c.knob_value):
                mean, std = c.stat("score") if what == "score" else mean_std([r.eval_value(what) for r in c.runs])
                if not math.isnan(mean):
                    pts.append((c.knob_value, mean, std))
            if not pts:
                continue
            drawn += 1
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[_nan0(p[2]) for p in pts], marker="o",
                        capsize=3, color=f"C{i}", label=series)
        if what == "gold_reward" or (what == "score" and all(r.evaluated for c in cells for r in c.runs)):
            _sft_line(ax, cells, sft, "gold_reward" if what == "gold_reward" else "gold_win_rate")
        knob = cells[0].knob_label.split("=")[0] if cells else "knob"
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{knob} (log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    fig.suptitle("Final score against the off-policy knob (mean ± std over seeds)", fontsize=10)
    return _save(fig, path, _notes(cells) + ([] if drawn else ["no cell has a finite score"]))


def winrate_vs_wallclock(cells, path: str) -> str:
    from matplotlib.lines import Line2D

    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    label = score_label(cells).rstrip(" †")
    handles = []
    for i, (series, cs) in enumerate(_by_series(cells).items()):
        color = f"C{i}"
        xs = [c.stat("wall_seconds") for c in cs]
        ys = [c.stat("score") for c in cs]
        left.plot([x[0] for x in xs], [y[0] for y in ys], ls=":", color=color, lw=1)
        for c, (x, xe), (y, ye) in zip(cs, xs, ys):
            left.errorbar([x], [y], xerr=[_nan0(xe)], yerr=[_nan0(ye)], capsize=3, color=color, markersize=8,
                          marker="s" if c.synchronous else "o", markerfacecolor="none" if c.synchronous else color)
            left.annotate(c.knob_label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
            _, times, means, stds = c.curve()
            if times:
                many = len(times) > 12  # training-reward curves: one point per step, smoothed
                window = max(1, len(times) // 10) if many else 1
                mean, std = _smooth(means, window), _smooth(stds, window)
                right.plot(times, mean, color=color, ls="--" if c.synchronous else "-",
                           marker=None if many else ("s" if c.synchronous else "o"), markersize=4,
                           markerfacecolor="none" if c.synchronous else color)
                right.fill_between(times, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                   color=color, alpha=0.08, lw=0)
                right.annotate(c.knob_label, (times[-1], mean[-1]), textcoords="offset points", xytext=(4, 0),
                               fontsize=7, color=color)
        handles.append(Line2D([], [], color=color, ls="-", label=series))
    handles += [Line2D([], [], color="0.3", marker="s", markerfacecolor="none", ls="--",
                       label="synchronous (N=1 / S=0)"),
                Line2D([], [], color="0.3", marker="o", ls="-", label="asynchronous")]
    left.legend(handles=handles, fontsize=8)
    left.set_xlabel("training wall time of the run (s; generator start-up included)")
    left.set_ylabel(label)
    left.set_title("Final score vs wall-clock time (mean ± std over seeds;\nup and left is better)", fontsize=10)
    right.set_xlabel("elapsed time since train() began (s)")
    right.set_ylabel(label)
    right.set_title("Score during the run vs elapsed time\n(mean over seeds, shaded ± std)", fontsize=10)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    return _save(fig, path, _notes(cells, time_axis=True))


def winrate_over_steps(cells, path: str, sft: dict | None = None) -> str:
    plt = _pyplot()
    groups = _by_series(cells)
    colors = _knob_colors(plt, cells)
    label = score_label(cells).rstrip(" †")
    evaluated = all(r.evaluated for c in cells for r in c.runs)
    metrics = [(None, label, "gold_win_rate")]  # (evaluation metric or the score, axis label, SFT reference)
    if evaluated and all(not math.isnan(r.eval_value("gold_reward")) for c in cells for r in c.runs):
        metrics.append(("gold_reward", "gold reward", "gold_reward"))  # a second row: the studies' own measure
    cols = len(groups) if len(metrics) > 1 and len(groups) <= 4 else 3
    fig, axes = _panels(plt, len(groups) * len(metrics), cols=cols)
    panels = [(metric, series, cs) for metric in metrics for series, cs in groups.items()]
    for ax, ((name, axis_label, reference), series, cs) in zip(axes, panels):
        for c in cs:
            steps, _, means, stds = c.curve(name)
            if not steps:
                continue
            many = len(steps) > 12
            window = max(1, len(steps) // 10) if many else 1
            mean, std = _smooth(means, window), _smooth(stds, window)
            ax.plot(steps, mean, color=colors[c.knob_value], ls="--" if c.synchronous else "-",
                    marker=None if many else "o", markersize=4,
                    label=c.knob_label + (" (sync)" if c.synchronous else ""))
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=colors[c.knob_value], alpha=0.12, lw=0)
        if evaluated:
            _sft_line(ax, cells, sft, reference)
        ax.set_title(series, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(axis_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    title = label[0].upper() + label[1:] + (" and gold reward" if len(metrics) > 1 else "")
    wrap = "\n" if len(metrics) > 1 and cols == 1 else " "  # one panel wide: the title on two lines
    fig.suptitle(f"{title} over training,{wrap}one line per off-policy setting", fontsize=11)
    note = ("gold evaluations logged during training plus the final one; mean ± std over seeds" if evaluated else
            "every logged training step, mean ± std over seeds, moving average over 10% of the steps")
    return _save(fig, path, _notes(cells) + [note])


def winrate_vs_kl_over_training(cells, path: str) -> str:
    plt = _pyplot()
    groups = _by_series(cells)
    colors = _knob_colors(plt, cells)
    fig, axes = _panels(plt, len(groups))
    drawn = 0
    for ax, (series, cs) in zip(axes, groups.items()):
        for c in cs:
            trail = c.win_rate_kl_path()
            if not trail:
                continue
            drawn += 1
            ax.plot([p[3] for p in trail], [p[1] for p in trail], marker="o", markersize=4, color=colors[c.knob_value],
                    ls="--" if c.synchronous else "-", label=c.knob_label + (" (sync)" if c.synchronous else ""))
            last_step, last_score, _, last_kl = trail[-1]
            ax.annotate(str(last_step), (last_kl, last_score), textcoords="offset points", xytext=(4, -3),
                        fontsize=6, color=colors[c.knob_value])
        ax.set_title(series, fontsize=10)
        ax.set_xlabel(kl_label(cs))
        ax.set_ylabel("gold win-rate")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle("Gold win-rate vs KL through training, one line per off-policy setting", fontsize=11)
    notes = ["one point per evaluation (during training, then the final one, labelled with its step); mean over "
             "seeds at each step"]
    if not drawn:
        notes.append("no gold evaluations to draw (this task has no gold reward)")
    return _save(fig, path, notes)


def staleness_histograms(cells, path: str) -> str:
    plt = _pyplot()
    groups = _by_series(cells)
    cols = max(len(cs) for cs in groups.values())
    fig, axes = plt.subplots(len(groups), cols, figsize=(2.8 * cols + 0.6, 2.4 * len(groups) + 0.6), squeeze=False)
    for row, (series, cs) in zip(axes, groups.items()):
        for ax, c in zip(row, cs):
            hist = c.staleness_histogram
            bound = c.staleness_bound
            top = max([bound] + list(hist))
            total = sum(hist.values())
            ks = list(range(top + 1))
            ax.bar(ks, [hist.get(k, 0) / (total or 1) for k in ks], color="C0", width=0.8)
            ax.axvline(bound + 0.5, color="C3", ls="--", lw=1)
            ax.set_xticks(ks if len(ks) <= 10 else ks[:: math.ceil(len(ks) / 10)])
            ax.set_xlim(-0.6, top + 1)
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{series}  {c.knob_label}\nbound S={bound}, {total} batches", fontsize=8)
            ax.set_xlabel("staleness (optimizer steps)", fontsize=8)
            ax.set_ylabel("fraction of batches", fontsize=8)
            ax.tick_params(labelsize=7)
        for ax in row[len(cs):]:
            ax.set_visible(False)
    fig.suptitle("Staleness of the trained batches (summed over seeds; dashed red line: the bound)", fontsize=10)
    return _save(fig, path, [])


def draw_all(cells, plots_dir: str, sft: dict | None = None) -> list[str]:
    """Every figure of the sweep into plots_dir; returns their paths (always the same files, FILES). `sft`: the SFT
    policy's evaluation, drawn as a reference line where the runs do not carry it."""
    os.makedirs(plots_dir, exist_ok=True)
    drawers = (winrate_vs_kl, functools.partial(score_vs_knob, sft=sft), winrate_vs_wallclock,
               functools.partial(winrate_over_steps, sft=sft), winrate_vs_kl_over_training, staleness_histograms)
    return [draw(cells, os.path.join(plots_dir, name)) for draw, name in zip(drawers, FILES)]
