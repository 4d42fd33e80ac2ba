"""The score's and KL's names and labels, shared by the table (evals/table.py) and the plots (evals/plots.py) so
both say the same thing about where a number comes from. Imports no other evals module: everything else may
import it without a circle."""

from __future__ import annotations

GOLD_SCORE, TRAIN_SCORE = "gold_win_rate", "objective/scores"
GOLD_KL, TRAIN_KL = "kl", "objective/kl"
KNOB_LETTERS = {"num_mini_batches": "N", "max_staleness": "S"}
SCORE_LABELS = {GOLD_SCORE: "gold win-rate", TRAIN_SCORE: "training reward (objective/scores)"}
KL_LABELS = {GOLD_KL: "KL to SFT (eval)", TRAIN_KL: "KL (training objective/kl)"}
FALLBACK_NOTE = ("no gold evaluation for this task: the training reward objective/scores (mean of the last 10% of "
                 "logged steps) stands in for the gold win-rate, and KL is the training objective/kl")


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

