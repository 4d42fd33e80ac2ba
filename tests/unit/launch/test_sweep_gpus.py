"""GPU packing of the local runner (launch/sweeping/gpus.py): disjoint slots, the refusal before anything starts,
and runs that hold different GPUs while they run (a stand-in recipe without torch records its
CUDA_VISIBLE_DEVICES and when it ran; seconds)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import yaml

from launch import sweep
from launch.sweeping.gpus import GpuError, GpuPool, plan_slots, visible_gpus
from launch.sweeping.grid import load_grid
from launch.sweeping.runs import expand
from launch.sweeping.schedule import run_sweep


def test_slots_are_disjoint_and_cover_jobs_times_gpus():
    assert plan_slots(2, 2, ["0", "1", "2", "3"], "test") == ["0,1", "2,3"]
    assert plan_slots(3, 1, ["4", "6", "7"], "test") == ["4", "6", "7"]  # the visible ids, not 0..n-1
    assert plan_slots(4, 0, [], "test") == []  # 0 GPUs per run: nothing packed


def test_more_gpus_than_visible_is_refused_naming_both_numbers():
    with pytest.raises(GpuError) as info:
        plan_slots(3, 2, ["0", "1", "2", "3"], "CUDA_VISIBLE_DEVICES=0,1,2,3")
    assert "--jobs 3 x --gpus_per_run 2 = 6 GPUs, but 4 are visible (CUDA_VISIBLE_DEVICES=0,1,2,3)" in str(info.value)
    assert "lower --jobs to 2" in str(info.value)
    with pytest.raises(GpuError, match="--gpus_per_run 2: only 1 GPU"):
        plan_slots(1, 2, ["0"], "test")


def test_visible_gpus_reads_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})[0] == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""})[0] == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"})[0] == ["0"]  # CUDA stops at an invalid entry


def test_pool_hands_out_each_slot_once():
    pool = GpuPool(["0", "1"])
    a, b = pool.take(), pool.take()
    assert {a, b} == {"0", "1"}
    with pytest.raises(RuntimeError):
        pool.take()
    pool.give(a)
    assert pool.take() == a


RECIPE = textwrap.dedent('''
    import json, os, sys, time
    import yaml
    with open(sys.argv[sys.argv.index("--config") + 1]) as f:
        o = yaml.safe_load(f)
    start = time.time()
    time.sleep(0.6)
    os.makedirs(o["output_dir"], exist_ok=True)
    with open(os.path.join(o["output_dir"], "gpus.json"), "w") as f:
        json.dump({"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time()}, f)
    with open(os.path.join(o["output_dir"], "run_summary.json"), "w") as f:
        json.dump({"steps": 1}, f)
''')


def _grid(tmp_path, jobs: int) -> str:
    recipe = tmp_path / "recipe.py"
    recipe.write_text(RECIPE)
    grid = {"launcher": "python", "num_mini_batches": [1, 2], "seeds": [1, 2], "jobs": jobs,
            "algorithms": {"stub": {"recipe": str(recipe)}}, "flags": {"task": "toy"}}
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    return str(path)


def test_running_runs_never_share_a_gpu(tmp_path, monkeypatch):
    """4 runs, 2 at a time, 2 GPUs each out of 4: every run sees 2 GPUs, and two runs that overlap in time see
    disjoint ones."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    grid = load_grid(_grid(tmp_path, jobs=2))
    runs = expand(grid)
    out = tmp_path / "out"
    slots = plan_slots(grid.jobs, 2, *visible_gpus())
    outcomes = run_sweep(grid, runs, str(out), grace=1, gpu_slots=slots)
    assert [o["status"] for o in outcomes] == ["finished"] * 4
    seen = [json.loads((out / "runs" / r.name / "gpus.json").read_text()) for r in runs]
    assert sorted(s["cuda"] for s in seen) == ["0,1", "0,1", "2,3", "2,3"]
    for i, a in enumerate(seen):
        for b in seen[i + 1:]:
            if a["start"] < b["end"] and b["start"] < a["end"]:  # ran at the same time
                assert not set(a["cuda"].split(",")) & set(b["cuda"].split(",")), (a, b)
    records = [json.loads((out / "runs" / r.name / "sweep_run.json").read_text()) for r in runs]
    assert [r["cuda_visible_devices"] for r in records] == [s["cuda"] for s in seen]


def test_sweep_refuses_too_many_gpus_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    out = tmp_path / "out"
    assert sweep.main(["--config", _grid(tmp_path, jobs=3), "--output_dir", str(out), "--gpus_per_run", "2"]) == 2
    assert "--jobs 3 x --gpus_per_run 2 = 6 GPUs, but 4 are visible" in capsys.readouterr().err
    assert not out.exists()
    assert sweep.main(["--config", _grid(tmp_path, jobs=3), "--output_dir", str(out), "--gpus_per_run", "1",
                       "--dry_run"]) == 0
    assert "GPU slots (CUDA_VISIBLE_DEVICES, one per running run): 0  1  2" in capsys.readouterr().out
    assert not out.exists()
    assert not os.path.exists(out)
