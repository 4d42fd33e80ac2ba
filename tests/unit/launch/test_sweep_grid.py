"""The sweep's grid validation and run expansion (launch/sweeping/), its static table of recipes, and evals/'s
arithmetic and archive. Nothing is launched (the recipe-table test runs each recipe's `--help` in one subprocess).
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from evals import aggregate, cells, run_result, table
from evals.archive import ARCHIVE, read_archive, records_from_dirs, write_archive
from launch import sweep
from launch.sweeping.grid import GridError, load_grid
from launch.sweeping.process import error_line
from launch.sweeping.recipe_flags import SWEEP_RECIPES, recipe_options
from launch.sweeping.runs import check_run_dirs, command, expand

ROOT = next(str(p) for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
BASE = {"algorithms": ["online_dpo", "rloo"], "num_mini_batches": [1, 2], "seeds": [1, 2],
        "flags": {"task": "toy", "max_steps": 4}}


def _write(tmp_path, grid: dict) -> str:
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return str(path)


def _error(tmp_path, grid: dict) -> str:
    with pytest.raises(GridError) as info:
        load_grid(_write(tmp_path, grid))
    return str(info.value)


# ---- validation ----------------------------------------------------------------------------------------------------
def test_unknown_top_level_key_is_named_with_a_suggestion(tmp_path):
    message = _error(tmp_path, {**BASE, "seed": [1]})
    assert "unknown key(s) 'seed' (did you mean seeds?)" in message and "grid.yaml" in message


def test_unknown_algorithm_names_the_known_recipes(tmp_path):
    message = _error(tmp_path, {**BASE, "algorithms": ["online_dpo", "vapo"]})
    assert "algorithms.vapo: unknown algorithm: there is no recipes/vapo.py" in message
    assert "online_dpo" in message and "rloo" in message


def test_missing_recipe_file_and_bad_algorithm_keys(tmp_path):
    assert "recipe recipes/nope.py does not exist" in _error(tmp_path, {**BASE, "algorithms": {"a": "recipes/nope.py"}})
    bad_key = {**BASE, "algorithms": {"a": {"recipe": "recipes/rloo.py", "flag": {}}}}
    assert "algorithms.a: unknown key(s) 'flag' (did you mean flags?)" in _error(tmp_path, bad_key)
    assert "letters, digits and '_'" in _error(tmp_path, {**BASE, "algorithms": {"a-b": "recipes/rloo.py"}})


@pytest.mark.parametrize("change, expected", [
    ({"num_mini_batches": None}, "give exactly one off-policy knob, got none"),
    ({"max_staleness": [0, 1]}, "give exactly one off-policy knob, got ['num_mini_batches', 'max_staleness']"),
    ({"num_mini_batches": [1, 1]}, "num_mini_batches: repeated values"),
    ({"num_mini_batches": [0, 2]}, "num_mini_batches: values must be >= 1, got 0"),
    ({"seeds": []}, "seeds: must be a non-empty list"),
    ({"seeds": [1, "2"]}, "seeds: values must be integers"),
    ({"jobs": 0}, "jobs: must be an integer >= 1"),
    ({"timeout_minutes": -1}, "timeout_minutes: must be a number > 0"),
    ({"launcher": "torchrun"}, "launcher: 'torchrun' is not 'accelerate' or 'python'"),
    ({"flags": {"task": "toy", "seed": 3}}, "flags.seed: set by the sweep"),
    ({"flags": {"task": "toy", "sync_every": 2}}, "flags.sync_every: set by the sweep"),
    ({"axes": {"output_dir": ["a", "b"]}}, "axes.output_dir: set by the sweep"),
    ({"axes": {"task": ["toy", "builtin"]}}, "flags.task: is also an axis"),
    ({"estimate": {"startup_seconds": 10}}, "estimate.seconds_per_step: missing"),
    ({"estimate": {"startup_seconds": 10, "seconds_per_step": {"online_dpo": 1}}},
     "estimate.seconds_per_step: no value for rloo"),
])
def test_grid_errors_name_the_key(tmp_path, change, expected):
    grid = {**BASE, **{k: v for k, v in change.items() if v is not None}}
    for key in [k for k, v in change.items() if v is None]:
        del grid[key]
    assert expected in _error(tmp_path, grid)


def test_flag_names_are_checked_against_each_recipe(tmp_path):
    """A typo in a flag, an algorithm's flag or an axis fails before anything runs, naming the recipe and the
    closest real option."""
    grid = {**BASE, "flags": {"task": "toy", "max_step": 4}}
    message = _error(tmp_path, grid)
    assert "flags.max_step: not an option of recipes/online_dpo.py (did you mean max_steps" in message
    grid = {**BASE, "algorithms": {"rloo": {"recipe": "recipes/rloo.py", "flags": {"num_generation": 4}}}}
    assert "algorithms.rloo.flags.num_generation: not an option of recipes/rloo.py" in _error(tmp_path, grid)
    grid = {**BASE, "axes": {"learning_rat": [1e-3, 1e-2]}}
    assert "axes.learning_rat: not an option" in _error(tmp_path, grid)


def test_recipes_outside_the_table_are_refused_or_left_to_check_their_own_flags(tmp_path):
    """recipes/sft.py has no off-policy knob: refused by name. A script outside recipes/ has no entry in the table:
    its flags are left for it to check, and like every recipe it is assumed to take the task flags."""
    assert "recipes/sft.py is not a recipe the sweep runs" in _error(tmp_path, {**BASE, "algorithms": ["sft"]})
    script = tmp_path / "my_recipe.py"
    script.write_text("")
    grid = load_grid(_write(tmp_path, {**BASE, "algorithms": {"mine": str(script)},
                                       "flags": {"anything_goes": 1}}))
    assert grid.recipe_options == {str(script): None}
    assert all(r.expects_eval for r in expand(grid))  # ScriptArguments: task builtin, eval_prompts 512


HELP_OF_EACH = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    buffer, sys.argv = io.StringIO(), [path, "--help"]
    with contextlib.redirect_stdout(buffer):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit:
            pass
    out[path] = buffer.getvalue()
print("HELP " + json.dumps(out))
"""


def test_static_recipe_table_matches_the_flags_each_recipe_accepts():
    """Every recipe under recipes/ whose --help offers the off-policy knob is in the sweep's table, and the table's
    classes give exactly the flags the recipe parses (its --help, one subprocess for all: the real parsers)."""
    paths = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.py")))
    proc = subprocess.run([sys.executable, "-c", HELP_OF_EACH, *paths], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("HELP ")), None)
    assert line, proc.stderr[-3000:]
    usage = {os.path.basename(p)[:-3]: text.split("\n\n")[0] for p, text in json.loads(line[len("HELP "):]).items()}
    accepted = {name: set(re.findall(r"\[--(\w+)", text)) for name, text in usage.items()}  # `[--flag ...]`
    sweepable = {name for name, flags in accepted.items() if "num_mini_batches" in flags}
    assert sweepable == set(SWEEP_RECIPES), "add the recipe to launch/sweeping/recipe_flags.py"
    for name in SWEEP_RECIPES:
        table = set(recipe_options(os.path.join(ROOT, "recipes", f"{name}.py")))
        negations = {f for f in accepted[name] if f.startswith("no_") and f[3:] in table}  # --no_<bool flag>
        assert accepted[name] - negations == table, name


def test_archive_holds_each_run_directory_parsed(tmp_path):
    """runs.jsonl reads back as the records of the directories: a torn metrics line (killed run) is dropped, a
    missing file stays missing, an unreadable one is named; a directory without sweep_run.json is not a run."""
    runs_dir = tmp_path / "runs"
    (runs_dir / "a").mkdir(parents=True)
    (runs_dir / "a" / "sweep_run.json").write_text(json.dumps({"name": "a", "seconds": 1.5}))
    (runs_dir / "a" / "config.yaml").write_text("seed: 1\nlearning_rate: 1.0e-05\n")
    (runs_dir / "a" / "metrics.jsonl").write_text('{"step": 1, "objective/scores": 0.1}\n{"step": 2, "obj')
    (runs_dir / "b").mkdir()
    (runs_dir / "b" / "sweep_run.json").write_text("{not json")
    (runs_dir / "c").mkdir()  # not made by the sweep
    assert write_archive(str(tmp_path)) == str(tmp_path / ARCHIVE)
    records = read_archive(str(tmp_path / ARCHIVE))
    assert records == records_from_dirs(str(runs_dir))
    assert records[0] == {"name": "a", "files": {"sweep_run.json": {"name": "a", "seconds": 1.5},
                                                 "config.yaml": {"seed": 1, "learning_rate": 1e-05},
                                                 "metrics.jsonl": [{"step": 1, "objective/scores": 0.1}]}}
    assert records[1]["name"] == "b" and list(records[1]["unreadable"]) == ["sweep_run.json"]
    assert run_result.run_from_record(records[1])["status"].startswith("unreadable sweep_run.json")


@pytest.mark.parametrize("archive", sorted(glob.glob(os.path.join(ROOT, "evals", "results", "*", ARCHIVE))),
                         ids=lambda p: os.path.basename(os.path.dirname(p)))
def test_committed_grid_regenerates_its_table_from_runs_jsonl(archive, tmp_path):
    """evals/results/<grid>/ keeps runs.jsonl instead of run directories; the table made from it alone is the
    committed one (plots left out here: results.md then only lacks its plot links)."""
    grid_dir = os.path.dirname(archive)
    assert not os.path.exists(os.path.join(grid_dir, "runs")), "commit runs.jsonl, not run directories"
    for name in (ARCHIVE, "sweep_report.json"):
        shutil.copy(os.path.join(grid_dir, name), tmp_path / name)
    assert aggregate.aggregate(str(tmp_path), plots=False)
    with open(os.path.join(grid_dir, "results.csv")) as f:
        assert (tmp_path / "results.csv").read_text() == f.read()
    with open(os.path.join(grid_dir, "results.md")) as f:
        committed = f.read().split("\n## Plots\n")[0].rstrip("\n") + "\n"
    assert (tmp_path / "results.md").read_text() == committed
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.DictReader(f))) > 0


def test_sft_baseline_is_the_trained_size_and_drawn_on_the_plots(tmp_path):
    """--sft_baseline gives the plots the SFT policy's reference for the one size every run trained; a file without
    that size, or runs of two sizes, are refused naming the file and the sizes; the figures are still drawn."""
    grid_dir = os.path.join(ROOT, "evals", "results", "sorting_policy_size")
    baseline = os.path.join(grid_dir, "sft_baseline.json")
    for name in (ARCHIVE, "sweep_report.json"):
        shutil.copy(os.path.join(grid_dir, name), tmp_path / name)
    runs, _ = run_result.load_runs(str(tmp_path))
    assert aggregate.sft_baseline(baseline, runs)["gold_reward"] == pytest.approx(1.0436, abs=1e-4)  # the small one
    written = aggregate.aggregate(str(tmp_path), sft_baseline_path=baseline)
    assert {os.path.basename(p) for p in written} >= {"score_vs_knob.png", "winrate_over_steps.png"}
    only_default = tmp_path / "default_only.json"
    only_default.write_text(json.dumps({"default": {"gold_reward": 1.06}}))
    with pytest.raises(aggregate.BaselineError, match=r"default_only.json: no entry for .*'small' \(it has: default\)"):
        aggregate.sft_baseline(str(only_default), runs)
    not_json = tmp_path / "not_json.json"
    not_json.write_text("{bad")
    with pytest.raises(aggregate.BaselineError, match="not_json.json: not JSON"):
        aggregate.sft_baseline(str(not_json), runs)
    runs[0].flags = {**runs[0].flags, "sorting_policy": "large"}
    with pytest.raises(aggregate.BaselineError, match="2 sizes \\(large, small\\)"):
        aggregate.sft_baseline(baseline, runs)


def test_every_shipped_grid_validates_and_expands():
    for name in ("quick", "paper_ablation", "async_vs_sync", "hub_tldr"):
        grid = load_grid(os.path.join(ROOT, "launch", "sweeps", f"{name}.yaml"))
        runs = expand(grid)
        assert len(runs) == len(grid.algorithms) * len(grid.knob_values) * len(grid.seeds) * math.prod(
            len(v) for v in grid.axes.values())
        if name in ("paper_ablation", "async_vs_sync"):  # the built-in task evaluates: runs wait for eval_results
            assert all(r.expects_eval for r in runs)
        if name == "quick":
            assert not any(r.expects_eval for r in runs)


def test_main_refuses_an_invalid_grid_with_exit_code_2(tmp_path, capsys):
    path = _write(tmp_path, {**BASE, "algorithm": ["rloo"]})
    assert sweep.main(["--config", path, "--output_dir", str(tmp_path / "out")]) == 2
    assert "unknown key(s) 'algorithm'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- expansion -----------------------------------------------------------------------------------------------------
def test_expand_names_and_flags(tmp_path):
    grid = load_grid(_write(tmp_path, {
        "algorithms": {"online_dpo": "recipes/online_dpo.py",
                       "best_of_4": {"recipe": "recipes/best_of_n.py", "flags": {"num_generations": 4}}},
        "max_staleness": [0, 1], "seeds": [7], "axes": {"learning_rate": [0.001, 0.01]},
        "flags": {"task": "builtin", "max_steps": 8, "num_generations": 2}}))
    runs = expand(grid)
    assert [r.name for r in runs][:3] == ["online_dpo-S0-learning_rate0.001-seed7",
                                          "online_dpo-S0-learning_rate0.01-seed7",
                                          "online_dpo-S1-learning_rate0.001-seed7"]
    best = next(r for r in runs if r.algorithm == "best_of_4")
    assert best.flags["num_generations"] == 4  # an algorithm's flags override the shared ones
    assert best.flags["max_staleness"] == 0 and best.flags["seed"] == 7 and best.flags["learning_rate"] == 0.001
    assert [r.index for r in runs] == list(range(len(runs)))


def test_finished_run_with_other_flags_is_refused(tmp_path):
    grid = load_grid(_write(tmp_path, BASE))
    run = expand(grid)[0]
    run_dir = tmp_path / "out" / "runs" / run.name
    run_dir.mkdir(parents=True)
    (run_dir / "run_summary.json").write_text("{}")
    record = {"name": run.name, "recipe": "recipes/online_dpo.py", "flags": {**run.flags, "max_steps": 2},
              "status": "finished"}
    (run_dir / "sweep_run.json").write_text(json.dumps(record))
    with pytest.raises(GridError, match="max_steps 2 -> 4"):
        check_run_dirs([run], str(tmp_path / "out" / "runs"), "grid.yaml")
    record["flags"] = run.flags
    (run_dir / "sweep_run.json").write_text(json.dumps(record))
    check_run_dirs([run], str(tmp_path / "out" / "runs"), "grid.yaml")  # same flags: fine, will be skipped


def test_error_line_prefers_the_last_exception_over_the_launcher_wrapper(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("Traceback (most recent call last):\n  File x\nasync_rlhf.errors.ConfigError: max_steps: bad\n"
                   "Traceback (most recent call last):\nsubprocess.CalledProcessError: Command '...' returned 1.\n")
    assert error_line(str(log)) == "async_rlhf.errors.ConfigError: max_steps: bad"


# ---- aggregation arithmetic ----------------------------------------------------------------------------------------
def test_mean_std_is_the_sample_std():
    assert cells.mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)  # sqrt(((1-2)^2 + 0 + (3-2)^2) / (3 - 1)) = 1
    mean, std = cells.mean_std([0.5])
    assert mean == 0.5 and math.isnan(std)
    assert all(math.isnan(x) for x in cells.mean_std([]))


def test_eval_metrics_read_both_naming_styles():
    line = {"step": 4, "eval/gold_win_rate": 0.6, "eval_kl": 1.5, "eval/other": 3, "objective/kl": 9.0}
    assert run_result.eval_metrics(line) == {"gold_win_rate": 0.6, "kl": 1.5}


def _result(**kw) -> "run_result.RunResult":
    base = dict(name="r", algorithm="a", knob="num_mini_batches", knob_value=2, seed=1, axes={},
                summary={"steps": 10, "samples": 40, "wall_seconds": 12.0, "loop_seconds": 10.0,
                         "generator_start_seconds": 2.0, "dropped": 1, "staleness_histogram": {"0": 5, "1": 5}},
                eval=None, steps=[{"step": s, "objective/scores": float(s), "objective/kl": 0.1 * s}
                                  for s in range(1, 11)])
    return run_result.RunResult(**{**base, **kw})


def test_run_result_fallback_and_gold_scores():
    r = _result()
    assert r.score_source == "objective/scores" and r.score == 10.0  # last 10% of 10 steps: step 10 only
    assert r.kl == pytest.approx(1.0)
    assert r.samples_per_s == 4.0 and r.dropped_samples == 4.0  # 1 dropped batch of 40 / 10 samples
    assert r.elapsed({"step": 5}) == 7.0  # start-up 2 s + 5 x (10 s / 10 steps)
    gold = _result(eval={"gold_win_rate": 0.7, "kl": 2.0}, evals=[{"step": 5, "gold_win_rate": 0.55}])
    assert gold.score == 0.7 and gold.kl == 2.0
    assert gold.score_curve() == [(5, 7.0, 0.55), (10, 12.0, 0.7)]  # during training, then the final evaluation


def test_cell_pools_staleness_over_seeds_and_keeps_only_shared_curve_steps():
    a, b = _result(seed=1), _result(seed=2, steps=_result().steps[:5])
    cell = cells.group_cells([a, b])[0]
    assert cell.staleness_histogram == {0: 10, 1: 10} and cell.staleness_mean == 0.5 and cell.staleness_max == 1
    steps, _, means, _ = cell.curve()
    assert steps == [1, 2, 3, 4, 5] and means == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_peak_is_the_best_point_of_the_seed_mean_curve_with_its_kl():
    def gold(seed, curve, final):  # curve: [(step, win-rate, kl)] during training; final at step 10
        return _result(seed=seed, eval={"gold_win_rate": final[0], "kl": final[1]},
                       evals=[{"step": s, "gold_win_rate": w, "kl": k} for s, w, k in curve])
    a = gold(1, [(5, 0.60, 1.0)], (0.50, 2.0))
    b = gold(2, [(5, 0.50, 1.2)], (0.54, 2.2))
    cell = cells.group_cells([a, b])[0]
    mean, std, step, kl = cell.peak()  # seed means: 0.55 at step 5, 0.52 at step 10 (the final evaluation)
    assert (step, mean, kl) == (5, pytest.approx(0.55), pytest.approx(1.1)) and std == pytest.approx(0.0707, abs=1e-4)
    assert cell.stat("score")[0] == pytest.approx(0.52)  # the table's main figure stays the final one
    row = table.table_rows([cell])[0]
    assert row["peak_step"] == 5 and row["peak_kl_mean"] == pytest.approx(1.1)
    fallback = cells.group_cells([_result()])[0]  # training reward only: no peak
    assert fallback.peak()[2] is None and math.isnan(fallback.peak()[0])


def test_command_is_accelerate_launch_of_the_recipe_with_the_run_config(tmp_path):
    grid = load_grid(_write(tmp_path, {**BASE, "accelerate_config": "launch/accelerate/cpu_1proc.yaml"}))
    run = expand(grid)[0]
    assert command(grid, run, "/out/runs/x") == [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", os.path.join(ROOT, "launch/accelerate/cpu_1proc.yaml"),
        os.path.join(ROOT, "recipes/online_dpo.py"), "--config", "/out/runs/x/config.yaml"]
    grid.launcher = "python"
    assert command(grid, run, "/out/runs/x") == [sys.executable, os.path.join(ROOT, "recipes/online_dpo.py"),
                                                       "--config", "/out/runs/x/config.yaml"]
