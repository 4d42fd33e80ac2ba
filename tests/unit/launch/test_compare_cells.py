"""evals/compare.py: cell means with t-intervals and contrasts with Welch intervals, checked by hand on small numbers
and against a finding a committed NOTES states (so the figure there is the tool's)."""

from __future__ import annotations

import math
import pathlib

import pytest
from scipy import stats

from evals import compare

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
RESULTS = ROOT / "evals" / "results"


def test_a_difference_of_two_cells_is_welchs():
    a, b = [1.0, 2.0, 3.0], [0.0, 0.5, 1.0, 1.5]
    e = compare.contrast([(1.0, a), (-1.0, b)])
    va, vb = 1.0 / 3, (5 / 12) / 4  # variance of each mean
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 3)
    half = stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    assert (e.value, e.df) == (pytest.approx(2.0 - 0.75), pytest.approx(df))
    assert (e.low, e.high) == (pytest.approx(1.25 - half), pytest.approx(1.25 + half))
    m = compare.mean_interval(a)
    assert (m.value, m.high - m.value) == (2.0, pytest.approx(stats.t.ppf(0.975, 2) * math.sqrt(1 / 3)))


def test_contrasts_parse_and_bad_ones_are_named():
    assert compare.parse_contrast("s_small:16 - s_small:1 - d:16 + d:1") == [
        (1.0, "s_small:16"), (-1.0, "s_small:1"), (-1.0, "d:16"), (1.0, "d:1")]
    with pytest.raises(SystemExit, match="expected terms"):
        compare.parse_contrast("ppo_none:16 minus ppo_none:1")
    with pytest.raises(SystemExit, match="no cell ppo:9"):
        compare.report({"ppo:1": {1: 1.0, 2: 2.0}}, ["ppo:9 - ppo:1"])
    one_seed = compare.report({"ppo:1": {1: 1.0}, "ppo:2": {1: 1.5}}, ["ppo:2 - ppo:1"])  # a --quick sweep
    assert one_seed[2] == "| ppo:1 | 1 | 1.000 | 1.000 [nan, nan] |"
    assert one_seed[-1] == ("| ppo:2 - ppo:1 | +0.500, no interval: ppo:2 has 1 seed, ppo:1 has 1 seed, an interval "
                            "needs 2 | |")


def test_the_five_seed_staleness_finding_is_what_the_notes_state():
    dirs = [str(RESULTS / "sorting_staleness"), str(RESULTS / "sorting_staleness_seeds45")]
    cells = compare.pool_cells(dirs, metric="gold_reward")
    assert sorted(cells["ppo_none:16"]) == [1, 2, 3, 4, 5]
    lines = compare.report(cells, ["ppo_none:16 - ppo_none:1"])
    assert "| ppo_none:16 - ppo_none:1 | -0.085 [-0.116, -0.054] |" in "\n".join(lines)
    notes = (RESULTS / "sorting_staleness_seeds45" / "NOTES.md").read_text()
    assert "-0.085 [-0.116, -0.054]" in notes
    with pytest.raises(SystemExit, match="seed 1 is also in an earlier directory"):
        compare.pool_cells(dirs[:1] * 2, metric="gold_reward")


def test_a_flag_two_grids_ran_an_algorithm_at_is_part_of_the_cell():
    """With `--by learning_rate`, the same algorithm name at two learning rates (two grids) makes two cells, not one
    cell with a seed twice; the interaction is what sorting_ppo_lr3e5's NOTES state."""
    dirs = [str(RESULTS / name) for name in ("sorting_staleness", "sorting_staleness_seeds45", "sorting_ppo_lr3e5")]
    with pytest.raises(SystemExit, match="name the flag: --by FLAG"):
        compare.pool_cells(dirs, metric="gold_reward")
    cells = compare.pool_cells(dirs, metric="gold_reward", by=("learning_rate",))
    assert {"ppo_none,learning_rate=3e-05:16", "ppo_none,learning_rate=0.0001:16",
            "rloo_none:16"} <= set(cells)  # RLOO ran at one rate: its name is unchanged
    low, high = "ppo_none,learning_rate=3e-05", "ppo_none,learning_rate=0.0001"
    lines = "\n".join(compare.report(cells, [f"{low}:16 - {low}:1 - {high}:16 + {high}:1"]))
    assert "+0.078 [+0.035, +0.121]" in lines
    assert "+0.078 [+0.035, +0.121]" in (RESULTS / "sorting_ppo_lr3e5" / "NOTES.md").read_text()
