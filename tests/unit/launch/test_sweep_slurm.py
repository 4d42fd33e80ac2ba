"""The Slurm backend's pieces that need no cluster (launch/sweeping/slurm.py, slurm_queue.py, cell_task.py): the
batch script, the resource checks and their messages, squeue and sinfo parsing, each cell's state, and the
multi-node launcher command. The cluster itself is tests/integration/test_sweep_slurm_cluster.py (slow tier)."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import yaml

from launch.sweeping import slurm
from launch.sweeping.grid import GridError, load_grid
from launch.sweeping.slurm_queue import cell_state, parse_squeue

pytest.importorskip("submitit")

ROOT = next(str(p) for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
QUICK = f"{ROOT}/launch/sweeps/quick.yaml"


def _grid(tmp_path, **extra):
    raw = yaml.safe_load(open(QUICK))
    raw.update(extra)
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_grid(str(path))


# ---- the batch script ------------------------------------------------------------------------------------------
def test_batch_script_holds_the_cell_allocation_the_array_and_the_time_limit_signal(tmp_path):
    grid = _grid(tmp_path, gpus_per_run=4, timeout_minutes=90,
                 slurm={"nodes_per_run": 2, "cpus_per_run": 8, "mem_gb": 64, "partition": "gpu",
                        "account": "rlhf", "sbatch": {"qos": "high", "constraint": "h100"}})
    res = slurm.resources(grid, {"jobs": 3})
    script = slurm.render(res, "/out/sweep", 12, "sweep_x")
    lines = script.splitlines()
    for expected in ("#SBATCH --array=0-11%3", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                     "#SBATCH --cpus-per-task=8", "#SBATCH --gpus-per-node=2", "#SBATCH --mem=64GB",
                     "#SBATCH --time=90", "#SBATCH --partition=gpu", "#SBATCH --account=rlhf",
                     "#SBATCH --qos=high", "#SBATCH --constraint=h100", "#SBATCH --signal=USR2@120",
                     "#SBATCH --job-name=sweep_x", "#SBATCH --output=/out/sweep/slurm/%A_%a/%A_%a_0_log.out",
                     f"cd {ROOT}"):
        assert expected in lines, (expected, script)
    assert lines[-1].startswith("srun --unbuffered") and "-m submitit.core._submit /out/sweep/slurm/%j" in lines[-1]
    assert sys.executable in lines[-1]  # the sweep's interpreter runs the cell


def test_one_cell_is_a_plain_job_and_command_line_overrides_the_grid(tmp_path):
    grid = _grid(tmp_path, slurm={"cpus_per_run": 8, "partition": "gpu"})
    res = slurm.resources(grid, {"cpus_per_run": 2, "partition": "debug", "sbatch": {"--qos": "low"},
                                 "signal_delay_s": 30})
    script = slurm.render(res, "/o", 1, "j")
    assert "--array" not in script
    assert "#SBATCH --cpus-per-task=2" in script and "#SBATCH --partition=debug" in script
    assert "#SBATCH --qos=low" in script and "#SBATCH --signal=USR2@30" in script
    assert "#SBATCH --time=5" in script  # the quick grid's timeout_minutes
    assert "--gpus-per-node" not in script and "--mem=" not in script


@pytest.mark.parametrize("extra, overrides, expected", [
    ({"gpus_per_run": 3, "slurm": {"nodes_per_run": 2}}, {}, "--gpus_per_run 3 is not divisible by --nodes_per_run 2"),
    ({}, {"cpus_per_run": 0}, "--cpus_per_run (slurm.cpus_per_run): must be an integer >= 1, got 0"),
    ({"slurm": {"mem_gb": -1}}, {}, "--mem_gb (slurm.mem_gb): must be a number > 0, got -1"),
    ({}, {"signal_delay_s": 250}, "--signal_delay_s 250 + 60 s (Slurm may send the signal that much early) is not "
                                  "shorter than the time limit (5 min = 300 s)"),
    ({"slurm": {"sbatch": {"time": "10"}}}, {}, "slurm.sbatch / --sbatch: time set by the sweep"),
    ({"launcher": "python", "accelerate_config": None, "slurm": {"nodes_per_run": 2}}, {},
     "--nodes_per_run 2: a cell of several nodes starts its ranks with accelerate launch"),
])
def test_resource_errors_name_the_field_and_the_numbers(tmp_path, extra, overrides, expected):
    if extra.get("accelerate_config", 0) is None:
        del extra["accelerate_config"]
        raw = yaml.safe_load(open(QUICK))
        raw.pop("accelerate_config")
        raw.update(extra)
        path = tmp_path / "grid.yaml"
        path.write_text(yaml.safe_dump(raw))
        grid = load_grid(str(path))
    else:
        grid = _grid(tmp_path, **extra)
    with pytest.raises(GridError) as info:
        slurm.resources(grid, overrides)
    assert expected in str(info.value)


def test_unknown_slurm_key_in_a_grid_is_named(tmp_path):
    with pytest.raises(GridError, match=r"slurm: unknown key\(s\) 'cpus_per_node' \(did you mean cpus_per_run"):
        _grid(tmp_path, slurm={"cpus_per_node": 2})


# ---- the cluster's shape --------------------------------------------------------------------------------------------
SINFO = "debug*|2|22000|(null)|1\ngpu|64|512000|gpu:h100:8(S:0-1)|4\ngpu|32|256000|gpu:4|2\n"


def test_sinfo_is_read_per_partition_with_its_largest_node():
    parts = slurm.parse_sinfo(SINFO)
    assert parts["debug"] == {"default": True, "cpus": 2, "mem_mb": 22000, "gpus": 0, "nodes": 1}
    assert parts["gpu"] == {"default": False, "cpus": 64, "mem_mb": 512000, "gpus": 8, "nodes": 6}


@pytest.mark.parametrize("overrides, expected", [
    ({"partition": "nope"}, "--partition nope: no such partition (the cluster has debug, gpu)"),
    ({"cpus_per_run": 4}, "--cpus_per_run 4: the nodes of partition debug have 2 CPUs"),
    ({"mem_gb": 64}, "--mem_gb 64: the nodes of partition debug have 21 GB"),
    ({"gpus_per_run": 16, "partition": "gpu"},
     "--gpus_per_run 16 (16 per node over 1 node(s)): the nodes of partition gpu have 8 GPUs"),
    ({"gpus_per_run": 1}, "--gpus_per_run 1 (1 per node over 1 node(s)): the nodes of partition debug have 0 GPUs"),
    ({"nodes_per_run": 8, "partition": "gpu"}, "--nodes_per_run 8: partition gpu has 6 node(s)"),
])
def test_a_cell_that_does_not_fit_is_refused_naming_both_numbers(tmp_path, overrides, expected):
    grid = _grid(tmp_path, gpus_per_run=overrides.pop("gpus_per_run", 0))
    with pytest.raises(slurm.SlurmError) as info:
        slurm.check_fits(slurm.resources(grid, overrides), slurm.parse_sinfo(SINFO))
    assert expected in str(info.value)


def test_a_fitting_cell_gets_the_default_partition(tmp_path):
    grid = _grid(tmp_path, gpus_per_run=8, slurm={"nodes_per_run": 2, "partition": "gpu"})
    assert slurm.check_fits(slurm.resources(grid, {}), slurm.parse_sinfo(SINFO)) == "gpu"
    assert slurm.check_fits(slurm.resources(_grid(tmp_path), {}), slurm.parse_sinfo(SINFO)) == "debug"


# ---- squeue and each cell's state ------------------------------------------------------------------------------------
def test_squeue_lines_expand_pending_array_ranges():
    text = "12_0|RUNNING|None\n12_[2-4,7%2]|PENDING|Resources\n13|COMPLETED|None\n12_1|FAILED|NonZeroExitCode\n" \
           "garbage line\n"
    entries = parse_squeue(text)
    assert entries["12_0"] == ("RUNNING", "None")
    assert [entries[f"12_{i}"] for i in (2, 3, 4, 7)] == [("PENDING", "Resources")] * 4
    assert "12_5" not in entries and entries["13"] == ("COMPLETED", "None")
    assert entries["12_1"] == ("FAILED", "NonZeroExitCode")
    assert len(entries) == 7


@pytest.mark.parametrize("record, finished, entry, state", [
    ({"status": "queued", "job_id": "1_0"}, False, ("PENDING", "Priority"), "queued"),
    ({"status": "running", "job_id": "1_0", "attempt": 1}, False, ("RUNNING", "None"), "running"),
    ({"status": "requeued", "job_id": "1_0", "attempt": 1}, False, ("PENDING", "BeginTime"), "requeued"),
    ({"status": "running", "job_id": "1_0", "attempt": 1}, False, ("REQUEUED", "None"), "requeued"),
    ({"status": "requeued", "job_id": "1_0", "attempt": 1}, False, ("RUNNING", "None"), "running"),
    ({"status": "failed", "job_id": "1_0", "message": "ValueError: x"}, False, ("FAILED", "NonZeroExitCode"), "failed"),
    ({"status": "running", "job_id": "1_0"}, False, ("CANCELLED", "None"), "failed"),
    ({"status": "running", "job_id": "1_0"}, False, ("TIMEOUT", "None"), "failed"),
    ({"status": "running", "job_id": "1_0"}, False, None, "failed"),  # forgotten by the scheduler, unfinished
    ({"status": "finished", "job_id": "1_0"}, True, None, "finished"),
    ({"status": "finished", "job_id": "1_0"}, True, ("COMPLETED", "None"), "finished"),
    (None, False, None, "not started"),
    ({"status": "failed", "message": "ValueError: x"}, False, None, "failed"),  # a local run
])
def test_cell_state_from_record_and_scheduler(record, finished, entry, state):
    assert cell_state(record, finished, entry)[0] == state


def test_failed_cell_detail_is_its_error_line_else_the_scheduler_state():
    assert cell_state({"status": "failed", "message": "ValueError: x"}, False, ("FAILED", "X")) == ("failed",
                                                                                                  "ValueError: x")
    assert cell_state({"status": "running"}, False, ("OUT_OF_MEMORY", "OutOfMemory")) == (
        "failed", "Slurm OUT_OF_MEMORY (OutOfMemory)")


# ---- inside the allocation -------------------------------------------------------------------------------------------
def test_several_nodes_get_accelerate_machine_ranks():
    from launch.sweeping.cell_task import node_command

    cmd = ["python", "-m", "accelerate.commands.launch", "--config_file", "c.yaml", "recipes/rloo.py", "--config", "x"]
    assert node_command(cmd, 1, 0, "n0") == cmd
    assert node_command(cmd, 2, 1, "n0") == ["python", "-m", "accelerate.commands.launch", "--num_machines", "2",
                                             "--machine_rank", "1", "--main_process_ip", "n0",
                                             "--main_process_port", "29500", "--config_file", "c.yaml",
                                             "recipes/rloo.py", "--config", "x"]


def test_cell_task_pickles_the_cell_not_its_process():
    import pickle

    from launch.sweeping.cell_task import CellTask

    task = CellTask("a-N1-seed1", "/r/a", ["python", "x.py"], False, 30.0, 1)
    task._proc, task._terminated = object(), True  # an attempt's state: never carried into the requeued task
    again = pickle.loads(pickle.dumps(task))
    assert (again.name, again.run_dir, again.cmd, again.grace) == ("a-N1-seed1", "/r/a", ["python", "x.py"], 30.0)
    assert again._proc is None and again._terminated is False


# ---- --status ------------------------------------------------------------------------------------------------------
def test_status_combines_the_scheduler_and_the_run_directories(tmp_path, monkeypatch, capsys):
    import json

    from launch.sweeping import slurm_queue, status

    runs = tmp_path / "runs"
    cells = {"a-N1-seed1": {"status": "finished", "job_id": "9_0"},
             "a-N2-seed1": {"status": "failed", "job_id": "9_1", "message": "ValueError: bad"},
             "b-N1-seed1": {"status": "requeued", "job_id": "9_2", "attempt": 1,
                            "message": "time limit or preemption: saved checkpoint-6, requeued to resume"},
             "b-N2-seed1": {"status": "queued", "job_id": "9_3"},
             "c-N1-seed1": {"status": "running", "job_id": "9_4", "attempt": 2}}
    for name, record in cells.items():
        (runs / name).mkdir(parents=True)
        (runs / name / "sweep_run.json").write_text(json.dumps({**record, "expects_eval": False}))
    (runs / "a-N1-seed1" / "run_summary.json").write_text("{}")
    asked = []
    monkeypatch.setattr(slurm_queue, "query", lambda ids: asked.append(sorted(ids)) or {
        "9_1": ("FAILED", "NonZeroExitCode"), "9_2": ("PENDING", "BeginTime"), "9_3": ("PENDING", "Priority"),
        "9_4": ("RUNNING", "None")})
    assert status.print_status(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert asked == [["9_0", "9_1", "9_2", "9_3", "9_4"]]
    assert "5 cells: 1 finished, 1 failed, 1 requeued, 1 queued, 1 running (Slurm asked)" in out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[1:]}
    assert "finished" in lines["a-N1-seed1"] and "ValueError: bad" in lines["a-N2-seed1"]
    assert "requeued" in lines["b-N1-seed1"] and "saved checkpoint-6" in lines["b-N1-seed1"]
    assert "queued" in lines["b-N2-seed1"] and "Priority" in lines["b-N2-seed1"]
    assert "running" in lines["c-N1-seed1"] and "attempt 2" in lines["c-N1-seed1"]

    monkeypatch.setattr(slurm_queue, "query", lambda ids: None)  # no squeue here: the records as written
    status.print_status(str(tmp_path))
    out = capsys.readouterr().out
    assert "squeue did not answer" in out and "as last recorded" in out


def test_dry_run_prints_plan_and_batch_script_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """On a machine without Slurm the script is printed unchecked, and said so; nothing is written or submitted."""
    from launch import sweep

    monkeypatch.setattr(slurm, "slurm_here", lambda: False)
    out = tmp_path / "out"
    assert sweep.main(["--quick", "--output_dir", str(out), "--backend", "slurm", "--cpus_per_run", "1",
                       "--dry_run"]) == 0
    printed = capsys.readouterr().out
    assert "8 to run" in printed and "#SBATCH --array=0-7%8" in printed and "#SBATCH --cpus-per-task=1" in printed
    assert "not checked against a cluster" in printed and not out.exists()


def test_stop_waits_for_a_recipe_that_outlives_its_launcher(tmp_path):
    """`accelerate launch` dies at once on SIGTERM while its recipe finishes its step and saves: stopping the group
    waits for the recipe (here: 1 s of saving), not only for the launcher that leads the group."""
    import time

    from launch.sweeping import process

    ready, saved = tmp_path / "ready", tmp_path / "saved"
    child = (f"import signal, time\ngot = []\nsignal.signal(signal.SIGTERM, lambda *a: got.append(1))\n"
             f"open({str(ready)!r}, 'w').close()\nwhile not got:\n    time.sleep(0.02)\ntime.sleep(1.0)\n"
             f"open({str(saved)!r}, 'w').close()\n")
    leader = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {child!r}])\ntime.sleep(60)\n"
    with open(tmp_path / "log", "w") as log:
        proc = process.start([sys.executable, "-c", leader], log, dict(os.environ))
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    process.stop([proc], grace=20)
    assert saved.exists() and time.monotonic() - t0 < 10
    assert proc.returncode == -15 and not process.group_alive(proc)  # the launcher died of SIGTERM at once
