"""`python launch/sweep.py --backend slurm` on a real Slurm: the one-node cluster of `scripts/slurm_local.sh`.

    bash scripts/slurm_local.sh up
    python -m pytest tests/integration/test_sweep_slurm_cluster.py -m slow -q
    bash scripts/slurm_local.sh down

Every test here is in the slow tier and is skipped when no Slurm controller answers (`sinfo`). They check:
- the quick grid (cut to two algorithms, one seed) gives the same table through Slurm as through the local backend,
  a failing cell is reported with its error line while the others finish, `--status` shows each cell, and a rerun
  submits nothing;
- a cell told its time limit is near (the SIGUSR2 Slurm sends `signal_delay_s` before it, here sent by `scancel
  --signal`) checkpoints, is requeued and resumes: every step's loss and score equal an uninterrupted run's;
- Ctrl-C on the sweep cancels its array: no task of it stays queued or running;
- bad input is refused before anything is submitted: an unknown partition, more GPUs or CPUs per run than a node
  has, and sbatch options the scheduler rejects (sbatch --test-only).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from test_sweep import FAKE_RECIPE

pytest.importorskip("submitit")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(ROOT, "launch", "sweep.py")


def _slurm_up() -> bool:
    if not shutil.which("sinfo"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _slurm_up(), reason="no Slurm controller (bash scripts/slurm_local.sh up)")]


def _sweep(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SWEEP, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _report(out) -> dict[str, dict]:
    with open(os.path.join(out, "sweep_report.json")) as f:
        return {r["name"]: r for r in json.load(f)["runs"]}


def _active_jobs() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %T"], capture_output=True, text=True, timeout=30).stdout
    return [ln for ln in out.splitlines() if ln.strip()]


def _table(out) -> list[dict]:
    """results.csv without the columns that measure time (they differ between any two runs)."""
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    timed = ("seconds", "per_s", "wall")
    return [{k: v for k, v in row.items() if not any(t in k for t in timed)} for row in rows]


def _quick_grid(tmp_path, **flags) -> str:
    with open(os.path.join(ROOT, "launch", "sweeps", "quick.yaml")) as f:
        grid = yaml.safe_load(f)
    grid["algorithms"] = {"online_dpo": "recipes/online_dpo.py", "ppo": "recipes/ppo.py",
                          "broken": {"recipe": "recipes/online_dpo.py", "flags": {"generator_backend": "no_such"}}}
    grid["num_mini_batches"] = [1, 2]
    grid["flags"].update(flags)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid, sort_keys=False))
    return str(path)


def test_quick_grid_through_slurm_gives_the_local_table_and_reports_the_failed_cell(tmp_path):
    grid = _quick_grid(tmp_path)
    local, cluster = tmp_path / "local", tmp_path / "slurm"
    first = _sweep("--config", grid, "--output_dir", str(local), "--only", "online_dpo", "--only", "ppo")
    assert first.returncode == 0, first.stdout + first.stderr
    t0 = time.monotonic()
    result = _sweep("--config", grid, "--output_dir", str(cluster), "--backend", "slurm", "--cpus_per_run", "1",
                    "--poll_seconds", "2")
    print(f"slurm sweep {time.monotonic() - t0:.0f}s\n{result.stdout}")
    assert result.returncode == 1, result.stdout + result.stderr  # the broken cells failed, the others finished
    report = _report(cluster)
    good = [f"{a}-N{n}-seed1" for a in ("online_dpo", "ppo") for n in (1, 2)]
    assert {n: report[n]["status"] for n in good} == {n: "finished" for n in good}
    for name in ("broken-N1-seed1", "broken-N2-seed1"):
        assert report[name]["status"] == "failed" and "generator_backend" in report[name]["message"], report[name]
    assert "log: " in result.stdout and "2 run(s) did not finish" in result.stdout
    for name in good:  # the same records as the local backend's, plus where Slurm ran them
        record = json.loads((cluster / "runs" / name / "sweep_run.json").read_text())
        assert record["backend"] == "slurm" and record["job_id"].count("_") == 1 and record["attempt"] == 1
        assert record["command"][-1] == str(cluster / "runs" / name / "config.yaml")
    assert _table(cluster) == _table(local)  # every number of the table but the measured times

    status = _sweep("--status", str(cluster))
    assert status.returncode == 0 and "4 finished, 2 failed" in status.stdout, status.stdout
    again = _sweep("--config", grid, "--output_dir", str(cluster), "--backend", "slurm", "--only", "online_dpo",
                   "--only", "ppo", "--no_aggregate")
    assert again.returncode == 0 and "4 already finished (skipped), 0 to submit" in again.stdout, again.stdout


def _metrics(run_dir) -> dict[int, dict]:
    """step -> (loss, score) of a run's metrics.jsonl (a later line of a step replaces an earlier one)."""
    out = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        m = json.loads(line)
        if "loss" in m:
            out[m["step"]] = (m["loss"], m["objective/scores"])
    return out


def test_cell_signalled_before_its_time_limit_checkpoints_is_requeued_and_resumes_exactly(tmp_path):
    grid = _quick_grid(tmp_path, max_steps=120)
    reference, cluster = tmp_path / "local", tmp_path / "slurm"
    name = "online_dpo-N2-seed1"  # asynchronous (N = 2: max_staleness 1), the harder case for an exact resume
    done = _sweep("--config", grid, "--output_dir", str(reference), "--only", name, "--no_aggregate")
    assert done.returncode == 0, done.stdout + done.stderr
    proc = subprocess.Popen([sys.executable, SWEEP, "--config", grid, "--output_dir", str(cluster), "--backend",
                             "slurm", "--only", name, "--poll_seconds", "1", "--no_aggregate"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = cluster / "runs" / name
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").is_file() or len(_metrics(run_dir)) < 30:
        assert proc.poll() is None and time.monotonic() < deadline, "the cell did not reach step 30"
        time.sleep(0.2)
    job = json.loads((run_dir / "sweep_run.json").read_text())["job_id"]
    # what `--signal=USR2@signal_delay_s` delivers before the time limit, now
    subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
    output = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, output
    record = json.loads((run_dir / "sweep_run.json").read_text())
    assert record["status"] == "finished" and record["attempt"] == 2, record
    assert record["resumed_from"] and record["resumed_from"].startswith("checkpoint-"), record
    log = (run_dir / "log.txt").read_text()
    assert "=== attempt 2" in log and "resuming from checkpoint-" in log
    want, got = _metrics(reference / "runs" / name), _metrics(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, 121))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-6), (step, want[step], got[step])


def test_ctrl_c_cancels_the_array(tmp_path):
    recipe = tmp_path / "fake_recipe.py"
    recipe.write_text(FAKE_RECIPE)
    grid = {"launcher": "python", "num_mini_batches": [1, 2], "seeds": [1, 2], "timeout_minutes": 10,
            "algorithms": {"stuck": {"recipe": str(recipe), "flags": {"mode": "hang"}}}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, SWEEP, "--config", str(path), "--output_dir", str(out), "--backend",
                             "slurm", "--cpus_per_run", "1", "--poll_seconds", "1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not any((out / "runs" / f"stuck-N1-seed{s}" / "pid").is_file() for s in (1, 2)):
        assert proc.poll() is None and time.monotonic() < deadline, "no cell started"
        time.sleep(0.2)
    job = json.loads((out / "runs" / "stuck-N1-seed1" / "sweep_run.json").read_text())["job_id"].split("_")[0]
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, output
    assert f"cancelled Slurm job {job}" in output
    deadline = time.monotonic() + 90  # KillWait: the running cells get SIGTERM, then SIGKILL
    while any(line.split()[0].startswith(f"{job}_") and line.split()[1] in ("PENDING", "RUNNING", "COMPLETING")
              for line in _active_jobs()):
        assert time.monotonic() < deadline, _active_jobs()
        time.sleep(1)
    statuses = {n: r["status"] for n, r in _report(out).items()}
    assert set(statuses.values()) <= {"interrupted", "not started"} and "interrupted" in statuses.values(), statuses


def test_bad_input_is_refused_before_anything_is_submitted(tmp_path):
    grid = _quick_grid(tmp_path)
    before = _active_jobs()
    out = tmp_path / "sweep"
    cases = [
        (["--partition", "no_such_partition"], "--partition no_such_partition: no such partition"),
        (["--gpus_per_run", "1"], "--gpus_per_run 1 (1 per node over 1 node(s)): the nodes of partition"),
        (["--cpus_per_run", str(os.cpu_count() + 1)], f"--cpus_per_run {os.cpu_count() + 1}: the nodes of partition"),
        (["--sbatch", "no-such-option=1"], "the scheduler rejected the batch script (sbatch --test-only)"),
        (["--sbatch", "constraint=no_such_feature"], "Invalid feature specification"),
    ]
    for extra, expected in cases:
        result = _sweep("--config", grid, "--output_dir", str(out), "--backend", "slurm", *extra, timeout=120)
        assert result.returncode == 2 and expected in result.stderr, (extra, result.stdout, result.stderr)
        assert not out.exists()
    bad = yaml.safe_load(open(grid))
    bad["slurm"] = {"sbatch": {"no-such-option": 1}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    result = _sweep("--config", str(tmp_path / "bad.yaml"), "--output_dir", str(out), "--backend", "slurm",
                    timeout=120)
    assert result.returncode == 2 and "check the grid's slurm.sbatch options" in result.stderr, result.stderr
    assert _active_jobs() == before and not out.exists()
