"""launch/sweep.py end to end, as a user runs it (`python launch/sweep.py ...` in a subprocess).

- `test_quick_grid_*`: the real recipes on the toy task (the `--quick` grid cut to one seed, plus a cell whose flag
  value the recipe rejects at run time): the runs finish, the bad one is reported without stopping the others and
  the exit code is 1, the table and the plots are written, and a second invocation skips the finished runs.
- `test_runner_*`: the runner's mechanics with a stand-in recipe (no torch, seconds): failure, timeout (the run's
  whole process group is killed), skip on rerun, refusing a finished run whose flags changed, the gold-evaluation
  path of the table (eval_results.json and evaluations logged in metrics.jsonl), and the table made again by
  `python evals/aggregate.py` from the sweep's runs.jsonl alone (how results are committed).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "launch", "sweep.py")
PLOTS = ("winrate_vs_kl.png", "score_vs_knob.png", "winrate_vs_wallclock.png", "winrate_over_steps.png",
         "winrate_vs_kl_over_training.png", "staleness_histograms.png")


def _sweep(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SWEEP, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _report(output_dir) -> dict[str, dict]:
    with open(os.path.join(output_dir, "sweep_report.json")) as f:
        return {r["name"]: r for r in json.load(f)["runs"]}


def _check_plots(output_dir) -> None:
    for name in PLOTS:
        path = os.path.join(output_dir, "plots", name)
        assert os.path.isfile(path), f"{name} not drawn"
        with open(path, "rb") as f:
            head = f.read(8)
        assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000, f"{name} is not a PNG with content"


# ---- the real recipes: the quick grid ----------------------------------------------------------------------------
@pytest.mark.slow  # 80 s: the runner's failures, timeouts, skips and table are checked in the default tier below
def test_quick_grid_runs_skips_reports_failures_and_aggregates(tmp_path):
    """The quick grid cut to online DPO and RLOO, one seed, 8 steps (N = 1, 2 on the toy task), plus `broken`: online
    DPO with a generator backend that does not exist, which only the recipe's config validation catches (the grid's
    flag names are all valid)."""
    with open(os.path.join(ROOT, "launch", "sweeps", "quick.yaml")) as f:
        grid = yaml.safe_load(f)
    grid["seeds"] = [1]
    grid["flags"]["max_steps"] = 8
    grid["algorithms"] = {name: grid["algorithms"][name] for name in ("online_dpo", "rloo")}
    grid["algorithms"]["broken"] = {"recipe": "recipes/online_dpo.py", "flags": {"generator_backend": "no_such_engine"}}
    grid_path = tmp_path / "grid.yaml"
    grid_path.write_text(yaml.safe_dump(grid, sort_keys=False))
    out = tmp_path / "sweep"
    good = ["online_dpo-N1-seed1", "online_dpo-N2-seed1", "rloo-N1-seed1", "rloo-N2-seed1"]
    bad = ["broken-N1-seed1", "broken-N2-seed1"]

    t0 = time.monotonic()
    first = _sweep("--config", str(grid_path), "--output_dir", str(out))
    first_seconds = time.monotonic() - t0
    assert first.returncode == 1, first.stdout + first.stderr
    report = _report(out)
    assert {n: report[n]["status"] for n in good} == {n: "finished" for n in good}, first.stdout
    for name in bad:
        assert report[name]["status"] == "failed"
        assert "generator_backend" in report[name]["message"], report[name]["message"]  # the recipe's own error
    assert "2 run(s) did not finish" in first.stdout
    assert (out / "runs.jsonl").is_file()
    for name in good:
        run_dir = out / "runs" / name
        for written in ("config.yaml", "log.txt", "sweep_run.json", "metrics.jsonl", "run_summary.json"):
            assert (run_dir / written).is_file(), f"{name}: no {written}"

    table = (out / "results.md").read_text()
    assert "training reward (objective/scores) †" in table  # toy task: no gold evaluation, and the table says so
    assert "`broken-N1-seed1`: failed" in table
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["algorithm"], r["knob_value"]) for r in rows) == [
        ("online_dpo", "1"), ("online_dpo", "2"), ("rloo", "1"), ("rloo", "2")]
    assert {r["score_source"] for r in rows} == {"objective/scores"}
    n2 = next(r for r in rows if r["algorithm"] == "online_dpo" and r["knob_value"] == "2")
    assert n2["staleness_bound"] == "1" and int(n2["staleness_max"]) <= 1
    _check_plots(out)

    mtimes = {n: os.path.getmtime(out / "runs" / n / "run_summary.json") for n in good}
    # again, leaving out the broken cell (retrying failed runs is checked with the stand-in recipe below): all
    # skipped, nothing rerun, exit code 0
    second = _sweep("--config", str(grid_path), "--output_dir", str(out), "--only", "online_dpo", "--only", "rloo",
                    "--no_aggregate")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "4 already finished (skipped), 0 to run" in second.stdout
    report = _report(out)
    assert {n: report[n]["status"] for n in good} == {n: "skipped" for n in good}
    assert {n: os.path.getmtime(out / "runs" / n / "run_summary.json") for n in good} == mtimes
    print(f"first invocation {first_seconds:.0f}s")


# ---- the runner with a stand-in recipe ---------------------------------------------------------------------------
FAKE_RECIPE = textwrap.dedent('''
    """Stand-in recipe: the options the sweep needs, and a `mode` that finishes, fails or hangs."""
    import json, os, sys, time
    from dataclasses import dataclass

    import yaml


    @dataclass
    class Options:
        output_dir: str = "out"
        seed: int = 0
        num_mini_batches: int = 1
        max_steps: int = 4
        # a script outside recipes/ is assumed to take async_rlhf.tasks.setup' flags, whose defaults (built-in task,
        # eval_prompts > 0) make the sweep expect eval_results.json; this stand-in writes it
        task: str = "builtin"
        eval_prompts: int = 8
        mode: str = "ok"  # ok | fail | hang


    def main(argv):
        with open(argv[argv.index("--config") + 1]) as f:
            o = Options(**yaml.safe_load(f))
        os.makedirs(o.output_dir, exist_ok=True)
        if o.mode == "fail":
            raise ValueError(f"mode: {o.mode!r} is a bad value")
        if o.mode == "hang":
            with open(os.path.join(o.output_dir, "pid"), "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        n = o.num_mini_batches
        with open(os.path.join(o.output_dir, "metrics.jsonl"), "w") as f:
            for step in range(1, o.max_steps + 1):
                line = {"step": step, "objective/scores": 0.1 * step + 0.01 * o.seed, "objective/kl": 0.5 * step}
                if step % 2 == 0:  # a gold evaluation during training rides on the next training log line
                    line.update({"eval/gold_win_rate": 0.5 + 0.05 * step / n, "eval/kl": 0.2 * step,
                                 "eval/seconds": 0.5})
                f.write(json.dumps(line) + "\\n")
        # 2 evaluations of 0.5 s during training: the table leaves them out of wall time and throughput
        summary = {"steps": o.max_steps, "samples": 8 * o.max_steps, "wall_seconds": 10.0 / n + 1,
                   "loop_seconds": 8.0 / n + 1,
                   "generator_start_seconds": 2.0, "max_staleness": n - 1, "dropped": 0,
                   "staleness_histogram": {str(k): o.max_steps // n for k in range(n)}}
        with open(os.path.join(o.output_dir, "run_summary.json"), "w") as f:
            json.dump(summary, f)
        with open(os.path.join(o.output_dir, "eval_results.json"), "w") as f:
            json.dump({"gold_win_rate": 0.6 + 0.1 * o.seed / n, "gold_reward": 1.0, "kl": 0.3 * n,
                       "sft_perplexity": 2.0}, f)


    if __name__ == "__main__":
        main(sys.argv[1:])
''')


def _fake_grid(tmp_path, algorithms: dict, **extra) -> str:
    recipe = tmp_path / "fake_recipe.py"
    recipe.write_text(FAKE_RECIPE)
    grid = {"description": "stand-in recipe", "launcher": "python", "num_mini_batches": [1, 2], "seeds": [1, 2],
            "algorithms": {name: {"recipe": str(recipe), "flags": {"mode": mode}} for name, mode in algorithms.items()},
            "flags": {"max_steps": 4}, **extra}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return str(path)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow  # 36 s; the grid's plan and the runner's SIGTERM stay in the default tier
def test_runner_failure_timeout_skip_and_gold_table(tmp_path):
    grid = _fake_grid(tmp_path, {"good": "ok", "bad": "fail", "stuck": "hang"}, jobs=3, timeout_minutes=0.05)
    out = tmp_path / "sweep"
    first = _sweep("--config", grid, "--output_dir", str(out), "--grace_seconds", "1", timeout=120)
    assert first.returncode == 1, first.stdout + first.stderr
    report = _report(out)
    assert [report[f"good-N{n}-seed{s}"]["status"] for n in (1, 2) for s in (1, 2)] == ["finished"] * 4
    bad = report["bad-N1-seed1"]
    assert bad["status"] == "failed" and bad["message"] == "ValueError: mode: 'fail' is a bad value"
    stuck = report["stuck-N2-seed2"]
    assert stuck["status"] == "timeout" and "timeout" in stuck["message"]
    for s in (1, 2):  # the hung recipe was killed with its process group
        for n in (1, 2):
            assert not _alive(int((out / "runs" / f"stuck-N{n}-seed{s}" / "pid").read_text()))
    assert "8 run(s) did not finish" in first.stdout

    # the table uses the gold evaluation: eval_results.json's win-rate, mean ± std over the two seeds
    with open(out / "results.csv") as f:
        rows = {(r["algorithm"], r["knob_value"]): r for r in csv.DictReader(f)}
    assert set(rows) == {("good", "1"), ("good", "2")}
    n1 = rows[("good", "1")]
    assert n1["score_source"] == "gold_win_rate" and n1["kl_source"] == "kl"
    assert float(n1["score_mean"]) == pytest.approx(0.75)  # 0.6 + 0.1 * seed / N, seeds 1 and 2, N = 1
    assert float(n1["score_std"]) == pytest.approx(0.0707107, rel=1e-4)  # |0.7 - 0.8| / sqrt(2)
    assert float(n1["gold_reward_mean"]) == 1.0 and float(n1["sft_perplexity_mean"]) == 2.0
    assert float(rows[("good", "2")]["staleness_mean"]) == 0.5  # {0: 2, 1: 2} per seed
    assert float(n1["samples_per_s_mean"]) == 4.0  # 32 samples / (9 loop seconds - 2 x 0.5 s of evaluation)
    assert float(n1["wall_seconds_mean"]) == 10.0  # 11 s less the evaluations
    table = (out / "results.md").read_text()
    assert "gold win-rate" in table and "†" not in table and "0.75 ± 0.071" in table
    _check_plots(out)

    # runs.jsonl holds every run directory's records: the table made from it alone is the same
    with open(out / "runs.jsonl") as f:
        assert sorted(json.loads(line)["name"] for line in f) == sorted(os.listdir(out / "runs"))
    again = tmp_path / "from_archive"
    again.mkdir()
    for name in ("runs.jsonl", "sweep_report.json"):
        (again / name).write_bytes((out / name).read_bytes())
    rebuilt = subprocess.run([sys.executable, "evals/aggregate.py", str(again), "--no_plots"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert (again / "results.csv").read_text() == (out / "results.csv").read_text()

    second = _sweep("--config", grid, "--output_dir", str(out), "--grace_seconds", "1", "--only", "good",
                    "--only", "bad", "--no_aggregate", timeout=120)
    assert second.returncode == 1
    assert "4 already finished (skipped), 4 to run" in second.stdout

    # a finished run whose flags change would mix two settings in one cell: refused before anything starts
    changed = yaml.safe_load(open(grid))
    changed["flags"]["max_steps"] = 6
    with open(grid, "w") as f:
        yaml.safe_dump(changed, f)
    third = _sweep("--config", grid, "--output_dir", str(out), "--only", "good", timeout=120)
    assert third.returncode == 2
    assert "finished earlier with different settings" in third.stderr and "max_steps 4 -> 6" in third.stderr


def test_runner_dry_run_prints_plan_and_estimate(tmp_path):
    grid = _fake_grid(tmp_path, {"good": "ok"}, estimate={"startup_seconds": 30, "seconds_per_step": 2.5})
    result = _sweep("--config", grid, "--output_dir", str(tmp_path / "sweep"), "--dry_run", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "4 to run" in result.stdout and "good-N2-seed2" in result.stdout
    assert "~3 min" in result.stdout  # 4 runs x (30 s + 4 steps x 2.5 s) = 160 s, one at a time
    assert not (tmp_path / "sweep").exists()  # a dry run writes nothing


@pytest.mark.slow  # suite time (15 s of sleeping runs)
def test_runner_sigterm_stops_running_runs_and_exits_130(tmp_path):
    grid = _fake_grid(tmp_path, {"stuck": "hang"}, jobs=2)
    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, SWEEP, "--config", grid, "--output_dir", str(out), "--grace_seconds", "2"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid_files = [out / "runs" / f"stuck-N1-seed{s}" / "pid" for s in (1, 2)]
    deadline = time.monotonic() + 60
    while not all(p.is_file() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline and proc.poll() is None, "the two runs did not start"
        time.sleep(0.2)
    proc.terminate()  # SIGTERM to the sweep, as `kill` or a job scheduler would send
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output
    assert not any(_alive(int(p.read_text())) for p in pid_files)
    statuses = {name: r["status"] for name, r in _report(out).items()}
    assert statuses == {"stuck-N1-seed1": "interrupted", "stuck-N1-seed2": "interrupted",
                        "stuck-N2-seed1": "not started", "stuck-N2-seed2": "not started"}
